"""Fast decoding: the model's one-token step compiled once against a static KV cache.

The recipe is gpt-fast's. A decode step of a small model is one-row matrix products over every weight plus a
few hundred small ops; eager PyTorch pays Python and dispatch overhead for each op, and `generate`'s compiled
path adds its own per-step bookkeeping on top. Here the prompt runs eagerly (its length varies), then every
step is one call of a graph inductor compiled for fixed shapes: input [B, 1], position [1], cache
[B, kv_heads, L, head_dim] with L rounded up to `CACHE_BUCKET` so that replies of similar length share it.
B is the number of prompts, all of one length (a batch needs no padding): a chat reply is B = 1.

Every graph is compiled with inductor's `freezing`: the weights become constants, so inductor can merge the
projections that read the same input (q/k/v, gate/up) into one matrix product each (`cpp.enable_concat_linear`;
fewer, larger products: bf16 137 -> 162 tok/s on the 64M model) and prepack them for oneDNN's and MKL's
kernels. 16-bit and int8 weights also get inductor's own C++ matrix-product kernels where its autotuning finds
them faster (`max_autotune`: bf16 162 -> 193 tok/s, int8 weights 190 -> 301, at 30-50 s of compilation instead
of 15); fp32 picks its product kernel by the number of rows and the CPU's maker (`Fp32Products`: on Intel MKL's
plain product for one row, oneDNN's packed one from four; on AMD inductor's template for one row, oneDNN's
beyond). Every graph gets inductor's C++ wrapper, which calls its kernels without a Python frame per op. The
steps attend through `grouped_query_sdpa`, which reads the KV cache without copying it per query head (batch 8,
fp32: 306 -> 398 tok/s) and only as far as it has been written (batch 8: fp32 441 -> 486, bf16 982 -> 1238), and
after a graph's first call dynamo checks only the guards that tell this decoder's graphs apart.
Frozen weights are a snapshot, so a decoder must be rebuilt after the model is trained further; the saved state
dict is untouched.

`CompiledDecoder.generate` takes the subset of `model.generate`'s arguments the chat front ends use (greedy or
temperature / top-k / top-p sampling through transformers' own logits warpers, eos, a streamer, stopping
criteria) and returns what `generate` returns: prompt and new ids, a row per prompt, a row that ended early
filled with the pad id. Greedy fp32 output equals `generate`'s token for token (tests/test_decode.py);
anything it does not cover is refused with a ValueError.

`RowDecoder` compiles the same step for a server (`minimind.serving.CompiledBatchEngine`): over a `RowCache`,
whose rows are independent sequences, each at its own position, so sequences join and leave between steps.
"""

from __future__ import annotations

import contextlib
import itertools
import platform
import time
import types
import warnings

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from transformers import (
    AttentionInterface,
    DynamicCache,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# Cache lengths are multiples of this: one compiled graph serves every reply in a bucket, so a chat compiles again
# only when its context grows past the next multiple. The steps attend only the written part of the cache, which
# makes a long bucket free (64M model, 1024 against 256: batch 1 fp32 111 against 111 tok/s, bf16 206 against 204;
# batch 8 fp32 489 against 502) but for its memory: 25 MB of fp32 keys and values per row of a batch.
CACHE_BUCKET = 1024
_decoder_ids = itertools.count()


def grouped_query_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA that, for one query position, attends each key/value head once for all the query heads it serves.

    transformers' SDPA kernel copies every key/value head `num_attention_heads / num_key_value_heads` times
    whenever there is a mask (a static cache always has one) before attending: for a decode step that is a copy
    of the whole cache per layer, larger than the attention itself. With one query position the G query heads
    of a group are G rows against the same keys, so q [B, H, 1, Dh] is viewed as [B, K, G, Dh] and attends the
    cache as it is (the mask [B, 1, 1, S] broadcasts over the rows), up to the last position a row sees (a bool
    mask; `_filled_length`). Anything else goes to transformers' kernel.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # [B, K, G, Dh]
    if _attends_written_part(attention_mask):
        filled = _filled_length(attention_mask)
        key, value, attention_mask = key[:, :, :filled], value[:, :, :filled], attention_mask[..., :filled]
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)  # [B,K,G,Dh]
    return out.view(batch, 1, heads, head_dim), None  # [B, 1, H, Dh], as transformers' kernels return it


def _filled_length(mask):
    """One past the last cache position any row sees (mask: bool [B, 1, 1, S]). A static cache is longer than what
    has been written, up to a whole `CACHE_BUCKET` ahead, and attending only up to here leaves the unwritten keys
    and values unread (64M model, batch 8, decoders side by side: fp32 441 -> 486 tok/s, bf16 982 -> 1238). The
    length is data: a compiled step reads it as a scalar, so one graph serves every step of a bucket."""
    seen = mask.reshape(-1, mask.shape[-1]).any(dim=0)  # [S]
    filled = (seen.shape[0] - seen.flip(0).to(torch.uint8).argmax()).item()  # all False: the whole cache
    torch._check(filled >= 1)
    torch._check(filled <= seen.shape[0])
    return filled


def _attends_written_part(mask) -> bool:
    """Whether the grouped kernel cuts the cache at `_filled_length`: for a bool mask on the CPU (on a GPU reading
    the length would stop the host for the device in every layer, and nothing was measured there), eagerly
    always, and in a graph being compiled only if dynamo keeps a tensor's `.item()` in the graph (which
    `CompiledDecoder` turns on) rather than breaking it there."""
    if mask is None or mask.dtype != torch.bool or mask.device.type != "cpu":
        return False
    return not torch.compiler.is_compiling() or torch._dynamo.config.capture_scalar_outputs


# transformers' own registries for custom kernels: the name selects the kernel and, as for "sdpa", SDPA's masks.
GROUPED_QUERY_SDPA = "minimind_grouped_query_sdpa"
AttentionInterface.register(GROUPED_QUERY_SDPA, grouped_query_sdpa)
AttentionMaskInterface.register(GROUPED_QUERY_SDPA, sdpa_mask)


ONEDNN_MIN_ROWS = 4  # fp32 products of this many rows or more go to oneDNN's packed kernel


def cpu_vendor() -> str:
    """The CPU's maker as it reports itself ("GenuineIntel", "AuthenticAMD"); "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return next((vendor for vendor in ("GenuineIntel", "AuthenticAMD") if vendor in platform.processor()), "")


# MKL's fast code paths are Intel's own: on an AMD EPYC (Zen 4, AVX-512) its fp32 products read the weights at
# 6-17 GB/s against oneDNN's 18-23 and inductor's C++ template's 30. Unknown makers keep the Intel table (a CPU
# without MKL, as on ARM, has no MKL-packed products for the table to choose for).
INTEL_CPU = cpu_vendor() in ("GenuineIntel", "")


def fp32_product_kernel(rows: int, intel: bool = INTEL_CPU) -> str:
    """The kernel a compiled fp32 step multiplies `rows` rows by a frozen weight with (`Fp32Products`)."""
    if rows == 1:
        return "plain" if intel else "template"
    return "mkl" if intel and rows < ONEDNN_MIN_ROWS else "onednn"


class Fp32Products(CustomGraphPass):
    """An inductor pass for fp32 steps: each prepacked product (MKL's packed GEMM, which freezing puts in for every
    fp32 linear) gets the kernel that was fastest for its number of rows on the 64M model, 2 threads, decoders side
    by side in one process (tok/s). On an Intel Xeon:
    - one row: MKL's plain product with the weight laid out [in, out] contiguous (103 against 88 packed);
    - two or three rows: MKL's packed product stays (batch 2: 171 against 163 for oneDNN's);
    - four rows or more: oneDNN's packed product, as 16-bit weights get (batch 8: 504 against 469; batch 4 even,
      batch 16 808 against 792).
    On an AMD EPYC (Zen 4), where MKL runs slow:
    - one row: inductor's own C++ GEMM template, which the packed node lowers to when it is the only choice
      (`inductor_settings`; 120 against 60 for MKL's plain product and 79 for oneDNN's packed one);
    - two rows or more: oneDNN's packed product (batch 2: 142 against 73 for MKL's packed one; batch 8, in
      separate processes: 539 against 456 with autotuning between the template and MKL's packed product).
    Packing cannot simply be switched off per graph: inductor registers its packing patterns once per process, at
    the first frozen compile, and only if `cpp.weight_prepack` is on then; a bf16 or int8 decoder built later
    would lose its packed kernels."""

    def __call__(self, graph):
        module = graph.owning_module
        packed_linear = (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in packed_linear:
                continue
            inputs, _packed, weight, bias, _batch = node.args  # inputs [N, in], weight [out, in], a frozen constant
            rows = inputs.meta["val"].shape[0]
            kernel = fp32_product_kernel(rows)
            if kernel in ("mkl", "template"):
                continue
            with graph.inserting_before(node):
                if kernel == "plain":
                    # Inductor gives a one-row view the strides (0, 1); ATen's product copies such an input first
                    # (25 copies a token) because the stride reads as no leading dimension. (in, 1) is the same row.
                    row = self._with_leading_stride(graph, inputs)
                    weight_in_out = self._constant(
                        graph,
                        module,
                        weight,
                        "in_out",
                        lambda w: w.t().contiguous(),
                        weight.meta["val"].t().contiguous(),
                    )  # [in, out]
                    product = (
                        graph.call_function(torch.ops.aten.mm.default, (row, weight_in_out))
                        if bias is None
                        else graph.call_function(torch.ops.aten.addmm.default, (bias, row, weight_in_out))
                    )
                else:
                    # an opaque oneDNN tensor, which inductor lowers by the shape of the weight it packs
                    packed = self._constant(
                        graph,
                        module,
                        weight,
                        f"onednn_{rows}",
                        lambda w, rows=rows: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                        weight.meta["val"],
                    )
                    product = graph.call_function(
                        torch.ops.mkldnn._linear_pointwise.default, (inputs, packed, bias, "none", [], "")
                    )
            product.meta.update(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
        graph.eliminate_dead_code()  # the MKL-packed copies go with their last user

    @staticmethod
    def _with_leading_stride(graph, row):
        value = row.meta["val"]
        if value.stride(-1) != 1:  # not one run of memory: leave it to ATen
            return row
        strided = graph.call_function(
            torch.ops.aten.as_strided.default, (row, list(value.shape), [value.shape[-1], 1])
        )
        strided.meta["val"] = value.as_strided(value.shape, (value.shape[-1], 1))
        return strided

    @staticmethod
    def _constant(graph, module, weight, suffix, relaid, meta_value):
        """A frozen constant holding `relaid(weight)`, lowered by inductor as `meta_value` describes it."""
        name = f"{weight.target}_{suffix}"
        if not hasattr(module, name):
            module.register_buffer(name, relaid(getattr(module, weight.target)))
        node = graph.get_attr(name)
        node.meta["val"] = meta_value
        return node

    def uuid(self):
        return get_hash_for_files((__file__,))


def cache_length(needed: int) -> int:
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


def sampling_warpers(do_sample, temperature, top_k, top_p) -> LogitsProcessorList | None:
    """transformers' own logits warpers for these settings, as `generate` builds them; None for greedy."""
    if not do_sample:
        return None
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def choose_tokens(ids, logits, warpers):
    """The next token of each row [N, 1] from its logits [N, V]: the best one, or sampled through `warpers`."""
    logits = logits.float()
    if warpers is None:
        return logits.argmax(dim=-1, keepdim=True)
    scores = warpers(ids, logits)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)


class CompiledStep:
    """The model's one-token step compiled by inductor for fixed shapes (`compile=False`: the same step eagerly, which
    tests use to check a decode loop against `model.generate` without paying for compilation). A subclass says
    what one step is (`_forward_one(token, position, cache) -> logits`) and runs it through `_next_logits`."""

    def __init__(self, model, compile: bool = True):
        if model.training:
            raise ValueError(f"{type(self).__name__} needs a model in eval mode: call model.eval() first")
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.compiled = compile
        self.compile_seconds = 0.0  # time spent in the first call of each new cache length (compilation)
        self._step = torch.compile(self._own_step(), fullgraph=True, dynamic=False) if compile else self._forward_one
        self._compiled_for: Cache | None = None
        # The steps attend through grouped_query_sdpa where the model attends through SDPA (the prompt keeps the
        # model's kernel); an eager or flash-attention model keeps its own.
        attention = model.config._attn_implementation
        self.step_attention = GROUPED_QUERY_SDPA if attention == "sdpa" else attention

    def inductor_settings(self, batch: int) -> dict:
        """Set around each call, not passed as compile options: inductor also reads `freezing` outside the
        options' scope, and with options alone the weights were not prepacked (81 against 107 tok/s, bf16)."""
        # cpp_wrapper: the compiled graph's launcher in C++ instead of Python, 5-10% per decoded token.
        # weight_prepack stays on for every dtype: inductor registers its prepacking patterns once per process,
        # at the first frozen compile, and only if the flag is on then (fp32 takes the products it multiplies
        # better otherwise back out of MKL's packed form: Fp32Products).
        # max_autotune: inductor's C++ GEMM template against ATen's; it only paid off for 16-bit activations
        # (fp32 at batch 1 on a Xeon: 81 against 90). Where fp32 takes the template (`fp32_product_kernel`) it is
        # the only choice offered, so nothing is timed while compiling.
        sixteen_bit = self.dtype != torch.float32
        template = not sixteen_bit and fp32_product_kernel(batch) == "template"
        return {
            "freezing": True,
            "cpp_wrapper": True,
            "cpp.enable_concat_linear": True,
            "cpp.weight_prepack": True,
            "max_autotune": sixteen_bit or template,
            "max_autotune_gemm_backends": "CPP" if template else "CPP,ATEN",
            "post_grad_custom_pre_pass": Fp32Products() if self.dtype == torch.float32 else None,
            # autotuning reports every choice on stderr, which would land in the middle of a chat
            "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
        }

    def _own_step(self):
        """`_forward_one` bound to this decoder through a code object of its own. Dynamo keeps compiled graphs,
        and its limit of 8 recompilations, per code object: shared by every decoder, the ninth model or shape in
        a process (a web page switching models, a test session) would fall back to eager, and the graphs, with
        the frozen weights in them, would keep every earlier model alive."""
        code = self._forward_one.__func__.__code__
        own = code.replace(co_name=f"decode_step_{next(_decoder_ids)}")
        return types.MethodType(types.FunctionType(own, globals()), self)

    @contextlib.contextmanager
    def _step_kernel(self):
        """The model attends through `step_attention` for the duration of one step. The switch is the config's
        attribute, which every layer reads; the kernels it switches between give the same results."""
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = self.step_attention
        try:
            yield
        finally:
            config._attn_implementation = previous

    def _next_logits(self, token, position, cache):
        if self.compiled and cache is self._compiled_for:
            # Between the steps of one reply nothing dynamo's guards check changes (every module attribute and
            # tensor the step reads: about 0.4 ms a token on the 64M model), so only the guards that tell this
            # decoder's graphs apart run. The settings and the attention switch only matter while compiling:
            # patching them around every step cost 0.18 ms a token, 2% of a 64M fp32 step.
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._step(token, position, cache)
            except RuntimeError as error:  # raised before the graph runs: an input none of the graphs was built for
                if "skip_guard_eval_unsafe" not in str(error):
                    raise
        with self._step_kernel():
            if not self.compiled:
                return self._forward_one(token, position, cache)
            return self._compiled_logits(token, position, cache)

    @contextlib.contextmanager
    def _compile_settings(self, batch):
        # capture_scalar_outputs: the steps' attention reads how much of the cache is filled (_filled_length)
        with (
            torch._inductor.config.patch(self.inductor_settings(batch)),
            torch._dynamo.config.patch(capture_scalar_outputs=True),
        ):
            yield

    def _compiled_logits(self, token, position, cache):
        """A step on a cache this decoder has not stepped last (a new graph, or a graph of another cache length),
        with every guard checked; compilation happens here."""
        batch = token.shape[0]
        started = time.perf_counter()
        try:
            with self._compile_settings(batch):
                logits = self._step(token, position, cache)
        except Exception as error:  # compilation runs on fake tensors: the cache is untouched
            warnings.warn(
                f"torch.compile could not build the decode step ({type(error).__name__}: {error}); "
                "decoding without compilation from here on (minimind-chat --no-compile skips the try)",
                stacklevel=2,
            )
            self.compiled = False
            return self._forward_one(token, position, cache)
        self.compile_seconds += time.perf_counter() - started
        self._compiled_for = cache
        return logits

    def _forward_one(self, token, position, cache):
        raise NotImplementedError


class CompiledDecoder(CompiledStep):
    """`generate` for unpadded prompts, with the decode step compiled."""

    def __init__(self, model, compile: bool = True):
        super().__init__(model, compile)
        self._cache: StaticCache | None = None

    def _forward_one(self, token, position, cache):  # token [B, 1], position [1]
        out = self.model(input_ids=token, position_ids=position[None], cache=cache, use_cache=True)
        return out.logits[:, -1]  # [B, V]

    def _fresh_cache(self, batch: int, needed: int) -> StaticCache:
        length = cache_length(needed)
        if (
            self._cache is not None
            and self._cache.layers[0].max_cache_len == length
            and self._cache.layers[0].keys.shape[0] == batch
        ):
            self._cache.reset()
            return self._cache
        config = self.model.config
        cache = StaticCache(config=config, max_cache_len=length)
        cache.early_initialization(
            batch_size=batch,
            num_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.model.device,
        )
        # StaticCache marks its tensors as static addresses (for CUDA graphs). Freezing would then fold them into
        # the graph as constants, so in-place cache updates would write to a copy; as plain inputs they work.
        for layer in cache.layers:
            for tensor in (layer.keys, layer.values, layer.cumulative_length):
                tensor.__dict__.pop("_dynamo_static_input_type", None)
        self._cache = cache
        return cache

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        attention_mask=None,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        streamer=None,
        stopping_criteria: StoppingCriteriaList | None = None,
    ):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got {list(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "CompiledDecoder takes unpadded prompts of one length: attention_mask must be all "
                "ones; use model.generate for padded batches"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch, prompt_length = input_ids.shape
        if streamer is not None and batch > 1:
            raise ValueError(f"a streamer takes one sequence, got a batch of {batch}; stream one prompt at a time")
        # As in generate: with an eos id, a row that has ended (eos or a stopping criterion) goes on with the pad
        # id (the eos id when there is none).
        pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        cache = self._fresh_cache(batch, prompt_length + max_new_tokens)
        warpers = sampling_warpers(do_sample, temperature, top_k, top_p)
        stopping_criteria = stopping_criteria or StoppingCriteriaList()
        if streamer is not None:
            streamer.put(input_ids.cpu())

        logits = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        ids = input_ids
        for step in range(max_new_tokens):
            token = choose_tokens(ids, logits, warpers)  # [B, 1]
            if batch > 1 and eos_token_id is not None:
                token = torch.where(unfinished[:, None], token, pad_token_id)
            ids = torch.cat([ids, token], dim=1)
            if streamer is not None:
                streamer.put(token[0].cpu())
            if eos_token_id is not None:
                unfinished &= token[:, 0] != eos_token_id
            unfinished &= ~stopping_criteria(ids, logits).to(unfinished.device)
            if step + 1 == max_new_tokens or not bool(unfinished.any()):
                break
            position = torch.tensor([prompt_length + step], device=ids.device)
            logits = self._next_logits(token, position, cache)
        if streamer is not None:
            streamer.end()
        return ids


class _RowLayer(StaticLayer):
    """One layer of a `RowCache`: a step writes each row's key and value at that row's own position."""

    def __init__(self, keys, values, positions):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.positions = keys, values, positions
        self.batch_size, self.num_heads, _, self.k_head_dim = keys.shape
        self.v_head_dim, self.device, self.is_initialized = values.shape[-1], keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):  # [R, K, 1, Dh] each
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.keys[rows, :, self.positions] = key_states[:, :, 0]
        self.values[rows, :, self.positions] = value_states[:, :, 0]
        return self.keys, self.values  # [R, K, L, Dh]


class RowCache(Cache):
    """A static KV cache whose rows are independent sequences, each at its own position: what a server batching
    requests that arrive at different times needs (transformers' `StaticCache` keeps one position for the whole
    batch). `positions[r]` is where row r's next token goes; a prompt enters a row through `fill_row`, and
    `first(n)` is the same memory seen as its first n rows, so a step runs only as many rows as are busy."""

    def __init__(self, config, rows: int, length: int, dtype, device, _tensors=None):
        self.config = config
        if _tensors is None:
            shape = (config.num_hidden_layers, rows, config.num_key_value_heads, length, config.head_dim)
            _tensors = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(rows, dtype=torch.long, device=device),
            )
        self.keys, self.values, self.positions = _tensors  # [layers, R, K, L, Dh] twice, [R]
        super().__init__(layers=[_RowLayer(k, v, self.positions) for k, v in zip(self.keys, self.values)])

    @property
    def length(self) -> int:
        return self.keys.shape[3]

    def first(self, rows: int) -> RowCache:
        return RowCache(
            self.config,
            rows,
            self.length,
            None,
            None,
            _tensors=(self.keys[:, :rows], self.values[:, :rows], self.positions[:rows]),
        )

    def fill_row(self, row: int, prompt_cache: DynamicCache, index: int, length: int) -> None:
        """Row `row` takes the first `length` keys and values of sequence `index` of a prompt batch's cache."""
        for layer, prompt_layer in enumerate(prompt_cache.layers):
            self.keys[layer, row, :, :length] = prompt_layer.keys[index, :, :length]
            self.values[layer, row, :, :length] = prompt_layer.values[index, :, :length]
        self.positions[row] = length

    def move_row(self, source: int, target: int) -> None:
        """Row `target` takes over row `source`'s sequence (what has been written of it)."""
        written = int(self.positions[source])
        self.keys[:, target, :, :written] = self.keys[:, source, :, :written]
        self.values[:, target, :, :written] = self.values[:, source, :, :written]
        self.positions[target] = written


class RowDecoder(CompiledStep):
    """Decode steps over a `RowCache`: row r takes token r at its own position and sees only its own sequence.
    The step is compiled once per number of rows (the same inductor settings as `CompiledDecoder`'s, the same
    `grouped_query_sdpa`, which reads the cache only as far as the furthest row has written), so sequences can
    join and leave between steps without recompiling."""

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: RowCache, rows: list[int]):
        """The prompts run eagerly in one forward and prompt i's keys and values go to row `rows[i]`. Returns each
        prompt's last logits [N, V]. The prompts are right-padded to the longest: attention is causal, so no real
        token sees the padding after it, and each prompt's own positions are exact. One forward over N prompts
        costs far less than N (64M model, fp32, 8 prompts of 25 tokens: 97 against 255 ms)."""
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.model.device)
        longest = int(lengths.max())
        ids = torch.tensor([ids + [ids[-1]] * (longest - len(ids)) for ids in prompts], device=self.model.device)
        prompt_cache = DynamicCache(config=self.model.config)
        hidden = self.model.model(input_ids=ids, cache=prompt_cache, use_cache=True).last_hidden_state  # [N, T, D]
        last = hidden[torch.arange(len(prompts), device=hidden.device), lengths - 1]  # [N, D]
        for index, (row, length) in enumerate(zip(rows, lengths.tolist())):
            cache.fill_row(row, prompt_cache, index, length)
        return self.model.lm_head(last)  # [N, V]

    @torch.no_grad()
    def step(self, tokens, cache: RowCache):
        """tokens [R, 1] at `cache.positions` -> logits [R, V]; the caller moves the positions of busy rows on."""
        return self._next_logits(tokens, cache.positions, cache)

    def _forward_one(self, token, position, cache):  # token [R, 1], position [R]
        seen = torch.arange(cache.length, device=position.device)[None, :] <= position[:, None]  # [R, L]
        out = self.model(
            input_ids=token,
            position_ids=position[:, None],
            attention_mask=seen[:, None, None, :],
            cache=cache,
            use_cache=True,
        )
        return out.logits[:, -1]  # [R, V]


def quantize_weights_int8(model):
    """Weight-only int8 for every projection of the decoder layers, in place: torchao's `Int8WeightOnlyConfig`
    (one scale per output row), the 8-bit decode path. Each decode step then reads half the bytes of bf16. The
    embedding and the tied LM head stay 16-bit. The model must hold 16-bit weights (the activations' dtype), and
    is for inference from here on: the checkpoint on disk keeps the original weights."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"int8 weights pair with 16-bit activations, but the model holds {dtype}: load it with "
            "dtype=torch.bfloat16 first"
        )
    with warnings.catch_warnings():  # torchao's CUDA-only kernels announce their absence on a CPU machine
        warnings.simplefilter("ignore")
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as error:
            raise ImportError(
                f"int8 weights use torchao, which is not installed ({error}): pip install 'minimind[int8]'"
            ) from error
        quantize_(model.model.layers, Int8WeightOnlyConfig())
    return model
