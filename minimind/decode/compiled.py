"""The model's one-token step compiled once against a static KV cache (`CompiledStep`), and `CompiledDecoder`, the
`generate` of the chat front ends built on it.

The recipe is gpt-fast's. A decode step of a small model is one-row matrix products over every weight plus a
few hundred small ops; eager PyTorch pays Python and dispatch overhead for each op, and `generate`'s compiled
path adds its own per-step bookkeeping on top. Here the prompt runs eagerly (its length varies), then every
step is one call of a graph inductor compiled for fixed shapes: input [B, 1], position [1], cache
[B, kv_heads, L, head_dim] with L rounded up to `CACHE_BUCKET` so that replies of similar length share it.
B is the number of prompts, all of one length (a batch needs no padding): a chat reply is B = 1.

Every graph is compiled with inductor's `freezing`: the weights become constants, so inductor can merge the
projections that read the same input (q/k/v, gate/up) into one matrix product each (`cpp.enable_concat_linear`:
fewer, larger products) and prepack them for oneDNN's and MKL's kernels. 16-bit and int8 weights also get
inductor's own C++ matrix-product kernels where its autotuning finds them faster (`max_autotune`, at the price of
a longer compilation); fp32 picks its product kernel by the number of rows and the CPU's maker (`Fp32Products`:
on Intel MKL's plain product for one row, oneDNN's packed one from four; on AMD inductor's template for one row,
oneDNN's beyond). Every graph gets inductor's C++ wrapper, which calls its kernels without a Python frame per op.
The steps attend through `grouped_query_sdpa`, which reads the KV cache without copying it per query head and
only as far as it has been written, and after a graph's first call dynamo checks only the guards that tell this
decoder's graphs apart.
Frozen weights are a snapshot, so a decoder must be rebuilt after the model is trained further; the saved state
dict is untouched.

`CompiledDecoder.generate` takes the subset of `model.generate`'s arguments the chat front ends use (greedy or
temperature / top-k / top-p sampling through transformers' own logits warpers, eos, a streamer, stopping
criteria) and returns what `generate` returns: prompt and new ids, a row per prompt, a row that ended early
filled with the pad id. Greedy fp32 output equals `generate`'s token for token (tests/decode/test_compiled.py);
anything it does not cover is refused with a ValueError.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
import warnings

import torch
from transformers import StaticCache, StoppingCriteriaList
from transformers.cache_utils import Cache

from minimind.decode.attention import GROUPED_QUERY_SDPA
from minimind.decode.fp32_products import Fp32Products, fp32_product_kernel
from minimind.decode.sampling import choose_tokens, sampling_warpers

# Cache lengths are multiples of this: one compiled graph serves every reply in a bucket, so a chat compiles again
# only when its context grows past the next multiple. The steps attend only the written part of the cache, which
# makes a long bucket cost no decoding speed, only memory: keys and values for every position of every row.
CACHE_BUCKET = 1024
_decoder_ids = itertools.count()


def cache_length(needed: int) -> int:
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


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
        options' scope, and with options alone the weights were not prepacked."""
        # cpp_wrapper: the compiled graph's launcher in C++ instead of Python, which saves Python's work on every
        # decoded token.
        # weight_prepack stays on for every dtype: inductor registers its prepacking patterns once per process,
        # at the first frozen compile, and only if the flag is on then (fp32 takes the products it multiplies
        # better otherwise back out of MKL's packed form: Fp32Products).
        # max_autotune: inductor's C++ GEMM template against ATen's; it only paid off for 16-bit activations
        # (fp32 at batch 1 on a Xeon decoded slower with it). Where fp32 takes the template
        # (`fp32_product_kernel`) it is the only choice offered, so nothing is timed while compiling.
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
        # with the globals of the subclass's own module (RowDecoder's step reads rows.py's names)
        return types.MethodType(types.FunctionType(own, self._forward_one.__func__.__globals__), self)

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
            # tensor the step reads), so only the guards that tell this decoder's graphs apart run. The settings
            # and the attention switch only matter while compiling, so they are not patched around every step.
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
