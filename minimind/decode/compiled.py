"""The model's one-token step compiled once against a static KV cache (`CompiledStep`), and `CompiledDecoder`, the
`generate` of the chat front ends built on it.

The recipe is gpt-fast's. A decode step of a small model is one-row matrix products over every weight plus a
few hundred small ops; eager PyTorch pays Python and dispatch overhead for each op, and `generate`'s compiled
path adds its own per-step bookkeeping on top. Here the prompt runs eagerly (its length varies; its products go
through fbgemm where torch's own kernels have no arithmetic for the weights, `prompt_model`), then every
step is one call of a graph inductor compiled for fixed shapes: input [B, 1], position [1], cache
[B, kv_heads, L, head_dim] with L rounded up to `CACHE_BUCKET` so that replies of similar length share it.
B is the number of prompts, all of one length (a batch needs no padding): a chat reply is B = 1.

Every graph but those over `Int8RowSums` is compiled with inductor's `freezing`: the weights become constants, so
inductor can merge the projections that read the same input (q/k/v, gate/up) into one matrix product each
(`cpp.enable_concat_linear`: fewer, larger products) and prepack them for oneDNN's and MKL's kernels. 16-bit and
int8 weights also get inductor's own C++ matrix-product kernels where its autotuning finds them faster
(`max_autotune`, at the price of a longer compilation); fp32 picks its product kernel by the number of rows and the
CPU's maker (`Fp32Products`: on Intel MKL's plain product for one row, oneDNN's packed one from four; on AMD
inductor's template for one row, oneDNN's beyond). Every graph gets inductor's C++ wrapper, which calls its kernels
without a Python frame per op. The steps attend through `grouped_query_sdpa`, which reads the KV cache without
copying it per query head and only as far as it has been written (on the CPU as sums inductor fuses into the layer's
kernel), and after a graph's first call dynamo checks only the guards that tell this decoder's graphs apart.
Frozen weights are a snapshot (a loaded one-row step reads the norms and the embedding from the model itself, the
rest from its own merged copies), so a decoder must be rebuilt after the model is trained further; the saved state
dict is untouched.

`CompiledDecoder.generate` takes the subset of `model.generate`'s arguments the chat front ends use (greedy or
temperature / top-k / top-p sampling through transformers' own logits warpers, eos, a streamer, stopping
criteria) and returns what `generate` returns: prompt and new ids, a row per prompt, a row that ended early
filled with the pad id. Greedy fp32 output equals `generate`'s token for token (tests/decode/test_compiled.py);
anything it does not cover is refused with a ValueError.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
import types
import warnings

import torch
from transformers import StaticCache, StoppingCriteriaList
from transformers.cache_utils import Cache

from minimind.decode.attention import GROUPED_QUERY_SDPA
from minimind.decode.fbgemm import float16_rows_products, multiplies_through_fbgemm
from minimind.decode.fp32_products import Fp32Products, fp32_product_kernel
from minimind.decode.int8 import Int8RowSums, int8_activation_products, plain_weights, weight_only_int8_view
from minimind.decode.memory import lazy_zeros, zero_again
from minimind.decode.onednn import onednn_products
from minimind.decode.packages import (
    WEIGHTS_APART,
    StepPackages,
    code_digest,
    default_cache_dir,
    entry_material,
    inputs_signature,
    weights_digest,
)
from minimind.decode.sampling import choose_tokens, sampling_warpers
from minimind.decode.sixteen_bit_products import SixteenBitProducts
from minimind.hardware import cpu_caps, cpu_computes_natively, torch_kernels_avx512, usable_cpu_features
from minimind.heap import trim_heap

# Cache lengths are multiples of this: one compiled graph serves every reply in a bucket, so a chat compiles again
# only when its context grows past the next multiple. The steps attend only the written part of the cache, which
# makes a long bucket cost no decoding speed; on a CPU its memory is resident only where written (`lazy_zeros`).
CACHE_BUCKET = 1024
_decoder_ids = itertools.count()
_NOT_YET = object()
# torch.export, AOTInductor and dynamo keep tracing state in module globals: two decoders compiling at once (the
# page loading a second model while the first one's step is still being built in the background) would trace
# over each other, so builds take turns.
BUILD_LOCK = threading.RLock()
PREPARE_THREAD = "minimind-decode-prepare"  # the name of the thread that builds a step ahead of the first reply


def cache_length(needed: int) -> int:
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


class CompiledStep:
    """The model's one-token step compiled by inductor for fixed shapes (`compile=False`: the same step eagerly, which
    tests use to check a decode loop against `model.generate` without paying for compilation). A subclass says
    what one step is (`_forward_one(token, position, cache) -> logits`) and runs it through `_next_logits`."""

    def __init__(self, model, compile: bool = True, cache_dir=None, announce=None):
        if model.training:
            raise ValueError(f"{type(self).__name__} needs a model in eval mode: call model.eval() first")
        self.model = model
        self._rows_model = _NOT_YET  # `rows_model`, built for the first step of several rows
        self._onednn_model = _NOT_YET  # fp32 prompts through oneDNN (`prompt_model`), built for the first one
        self.dtype = next(model.parameters()).dtype
        self.compiled = compile
        self.compile_seconds = 0.0  # time spent building or loading the step of each new shape
        # What one-row steps run: the model, or where its weights are torchao's int8 tensors, the same weights over
        # plain tensors (`weight_only_int8_view`), which can be exported as the subclasses cannot. None where
        # neither holds (other tensor subclasses).
        self.plain_model = model if plain_weights(model) else weight_only_int8_view(model)
        # "aoti": AOTInductor packages kept in `cache_dir` (None: `default_cache_dir()`; False: none kept), built
        # once per model, shape, torch and CPU; "inductor": torch.compile in this process, where the model cannot
        # be exported or a package cannot be built. The same inductor settings either way. A step of several rows
        # whose model holds tensor subclasses (int8 weights by torchao's int8 activations) is compiled by
        # torch.compile too (`_packages`).
        self.backend = "aoti" if self.plain_model is not None and _exportable(self.plain_model) else "inductor"
        self.keep_steps(cache_dir, announce)
        self._packaged: dict[tuple, object] = {}  # inputs signature -> the loaded package's runner
        self._run = None  # the runner of the cache in `_compiled_for` (None: the torch.compile'd step)
        self._digests: tuple[str, str] | None = None
        # torch.compile's step, made where a package cannot be (torch.compile's wrapper alone takes memory)
        self._step = None if compile else self._forward_one
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
        # 16-bit weights on a CPU without arithmetic for them take the template alone: it widens them to fp32 in
        # registers (for AVX2 as for AVX-512), while autotuning against ATen's products, which have no 16-bit
        # arithmetic to use there, decoded far slower. Their one-row steps, and where torch's kernels stop at AVX2
        # their steps of several rows too, multiply as sums over blocks of weight rows instead
        # (`SixteenBitProducts`), which read the weights faster still; a product the pass leaves stays the
        # template's. One bfloat16 row with the arithmetic but without AMX's tiles takes the template alone too
        # (`_bfloat16_row_on_template`). int8 weights keep the autotuning, which did better there.
        sixteen_bit = self.dtype != torch.float32
        if sixteen_bit:
            template = plain_weights(self.model) and (
                cpu_computes_natively(self.dtype) is False or self._bfloat16_row_on_template(batch)
            )
        else:
            template = fp32_product_kernel(batch) == "template"
        sums = any(isinstance(module, Int8RowSums) for module in self.model_for(batch).modules())
        return {
            # Int8RowSums' byte extraction reads weights alone, which freezing would fold into float32 copies of
            # every weight, four times the int8 bytes: those steps keep the words as they are. Their loops are
            # bound by arithmetic, not by the bytes read, so each multiply and add is fused into one instruction,
            # and activations that several layers read (a norm's output, read by q, k and v) are computed once into
            # memory: inlined, each layer's loop recomputes them for every row of its weight.
            "freezing": not sums,
            **({"cpp.enable_floating_point_contract_flag": "fast", "realize_reads_threshold": 1} if sums else {}),
            "cpp_wrapper": True,
            "cpp.enable_concat_linear": True,
            "cpp.weight_prepack": True,
            "max_autotune": sixteen_bit or template,
            "max_autotune_gemm_backends": "CPP" if template else "CPP,ATEN",
            "post_grad_custom_pre_pass": self._products_pass(batch, template),
            # autotuning reports every choice on stderr, which would land in the middle of a chat
            "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
        }

    def _products_pass(self, batch: int, template: bool):
        """The inductor pass that picks the steps' product kernels: fp32's table, or blocked sums for 16-bit weights
        where they decoded faster than the products otherwise taken: one row of bfloat16 without bfloat16
        arithmetic (the template alone), one row of float16 on every CPU (with AVX-512's float16 arithmetic too,
        oneDNN's), and several rows of either where torch's kernels stop at AVX2. Where one bfloat16 row takes the
        template with the arithmetic (`_bfloat16_row_on_template`), only a tied LM head becomes sums, over the
        embedding's own rows: the template would pack a copy of them."""
        if self.dtype == torch.float32:
            return Fp32Products()
        if not (self._on_cpu and plain_weights(self.model)):
            return None
        if self._bfloat16_row_on_template(batch):
            return SixteenBitProducts(tied_head_only=True)
        slower = template or self.dtype == torch.float16
        return SixteenBitProducts() if slower and (batch == 1 or not torch_kernels_avx512()) else None

    @property
    def _on_cpu(self) -> bool:
        return next(self.model.parameters()).device.type == "cpu"  # where the kernels were measured

    def _bfloat16_row_on_template(self, batch: int) -> bool:
        """Whether a step of `batch` rows over bfloat16 weights takes inductor's C++ GEMM template alone on a CPU
        with bfloat16 arithmetic: one row where the CPU lacks AMX's tiles (an AMD Zen 4). There the template decoded
        faster than the blocked sums and than the products autotuning picked (oneDNN's or the template's); with
        the tiles oneDNN's product is faster (docs/performance.md, "The precision for the CPU")."""
        features = usable_cpu_features()
        return (
            batch == 1
            and self.dtype == torch.bfloat16
            and self._on_cpu
            and features is not None
            and "amx_bf16" not in features
            and cpu_computes_natively(torch.bfloat16) is True
        )

    @property
    def rows_model(self):
        """What steps of several rows run where it is not `model`, else None: int8 weights by int8 activations
        (`int8_activation_products`), 16-bit weights through fbgemm where torch's kernels stop at AVX2
        (`float16_rows_products`)."""
        if self._rows_model is _NOT_YET:
            rows = int8_activation_products if not plain_weights(self.model) else float16_rows_products
            self._rows_model = rows(self.model)
        return self._rows_model

    def model_for(self, batch: int):
        """The model a step of `batch` rows runs: `rows_model` for several rows where there is one, else
        `plain_model` where there is one, else `model`."""
        if batch > 1 and self.rows_model is not None:
            return self.rows_model
        return self.model if self.plain_model is None else self.plain_model

    def _packages(self, batch: int) -> bool:
        """Whether the step of `batch` rows is packaged (AOTInductor) rather than compiled by torch.compile."""
        return self.compiled and self.backend == "aoti" and _exportable(self.model_for(batch))

    def prompt_model(self, tokens: int):
        """The model a prompt of `tokens` tokens in all (every sequence's) runs: `rows_model` where that multiplies
        through fbgemm; fp32 weights on a CPU whose maker MKL does not serve fast, the model's own weights multiplied
        by oneDNN (`onednn_products`); else `model`. A prompt's products are products over several rows, which
        torch's own kernels compute in software where fbgemm's exist for them: 16-bit weights without 16-bit
        arithmetic and int8 weights without 8-bit dot products (docs/performance.md, "The precision for the CPU").
        With those dot products torchao's 8-bit activations, what steps of several rows take, made a prompt slower
        than the weight-only product, which it keeps."""
        if tokens < 2:
            return self.model
        if self.rows_model is not None and multiplies_through_fbgemm(self.rows_model):
            return self.rows_model
        if self._onednn_model is _NOT_YET:
            self._onednn_model = onednn_products(self.model)
        return self.model if self._onednn_model is None else self._onednn_model

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
        if self._run is not None and cache is self._compiled_for:
            # the loader's own call, without the Python wrapper's per-call parsing of its input and output specs
            return self._run.loader.boxed_run(self._step_inputs(token, position, cache))[0]
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
        settings = _uncached_under_caps(self.inductor_settings(batch))
        with (
            torch._inductor.config.patch(settings),
            torch._dynamo.config.patch(capture_scalar_outputs=True),
        ):
            yield

    def _compiled_logits(self, token, position, cache):
        """A step on a cache this decoder has not stepped last (a new graph, or a graph of another cache length),
        with every guard checked; compilation happens here."""
        batch = token.shape[0]
        self.model_for(batch)  # builds what the step runs before it is traced
        run = self._package_or_fallback(token, position, cache)
        if run is not None:
            self._run, self._compiled_for = run, cache
            return run.loader.boxed_run(self._step_inputs(token, position, cache))[0]
        self._run = None
        if self._step is None:
            self._step = torch.compile(self._own_step(), fullgraph=True, dynamic=False)
        started = time.perf_counter()
        try:
            with BUILD_LOCK, self._compile_settings(batch):
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

    # What a package's step takes besides the token and its position: the tensors of the cache it reads and writes
    # in place (`_cache_state`), and the cache seen over other tensors of the same shapes (`_cache_over`), which is
    # what the step is exported with.
    def _cache_state(self, cache) -> list[torch.Tensor]:
        raise NotImplementedError

    def _cache_over(self, cache, position, state):
        raise NotImplementedError

    def _step_inputs(self, token, position, cache) -> list[torch.Tensor]:
        return [token, position, *self._cache_state(cache)]

    def _material(self, inputs, batch: int) -> dict:
        if self._digests is None:  # reading every weight once per decoder, not once per shape
            # the plain model's tensors are every weight a step reads, int8 values and scales included
            self._digests = (weights_digest(self.plain_model), code_digest(self.model))
        settings = {**self.inductor_settings(batch), "step_attention": self.step_attention}
        return entry_material(self.model, type(self).__name__, inputs, settings, *self._digests)

    def is_packaged(self, batch: int, needed: int) -> bool:
        """Whether a package of the step for `batch` rows and a cache of `needed` positions is in the cache directory,
        so that the first reply of that shape loads it instead of compiling (what the commands announce)."""
        if not self._packages(batch):
            return False
        token, position, cache = self._example(batch, needed)
        return self.packages.has(self._material(self._step_inputs(token, position, cache), batch))

    def _example(self, batch: int, needed: int):
        raise NotImplementedError

    def keep_steps(self, cache_dir=None, announce=None) -> None:
        """Where this decoder keeps and looks for its packages (None: `default_cache_dir()`; False: nowhere) and what
        it calls with a line when it builds or reuses one."""
        self.packages = StepPackages(None if cache_dir is False else (cache_dir or default_cache_dir()))
        self.announce = announce

    def _package_or_fallback(self, token, position, cache):
        """`_package`, or None (with a warning) where the step cannot be packaged: then torch.compile builds it."""
        if not self._packages(token.shape[0]):
            return None
        try:
            with BUILD_LOCK:
                return self._package(token, position, cache)
        except Exception as error:  # export or AOTInductor failed
            warnings.warn(
                f"could not build an AOTInductor package of the decode step ({type(error).__name__}: "
                f"{str(error)[:300]}); compiling it with torch.compile, at every start",
                stacklevel=3,
            )
            self.backend = "inductor"
            return None

    def _package(self, token, position, cache):
        """The loaded package of the step for these inputs' shapes: from this decoder's own, the cache directory, or
        built (exported, compiled by AOTInductor with `inductor_settings`) and kept there."""
        # what the step runs, built before a package of it is loaded: its fbgemm products find their packed weights
        # by the values they were packed from
        model = self.model_for(token.shape[0])
        inputs = self._step_inputs(token, position, cache)
        signature = tuple(map(tuple, map(lambda row: tuple(map(str, row)), inputs_signature(inputs))))
        if signature in self._packaged:
            return self._packaged[signature]
        started = time.perf_counter()
        batch = token.shape[0]
        material = self._material(inputs, batch)
        # the package's names for the tensors the step holds unchanged (see `_ExportedStep`)
        own = {f"model.{name}": tensor.detach() for name, tensor in _named_tensors(model)}
        run = self.packages.load(material, own)
        if run is not None:
            self._say(
                f"reusing the compiled decode step from {self.packages.directory} "
                f"({time.perf_counter() - started:.1f} s)"
            )
        else:
            where = f"kept in {self.packages.directory} for later starts" if self.packages.directory else "not kept"
            self._say(
                f"compiling the decode step for {batch} row(s) x {_cache_positions(inputs)} cache positions "
                f"(about a minute on a CPU, once per model and shape; {where}) ..."
            )
            run = self.packages.build(material, lambda path: self._compile_package(inputs, cache, batch, path), own)
            self._say(f"compiled in {time.perf_counter() - started:.0f} s")
        self.compile_seconds += time.perf_counter() - started
        self._packaged[signature] = run
        return run

    def _compile_package(self, inputs, cache, batch, path):
        """Exports the step and builds its package at `path`. A one-row step keeps its weights apart from its
        library (`WEIGHTS_APART`), which a later start loads without a second copy of them. oneDNN's packed weights,
        which fp32 steps of several rows multiply by, are opaque tensors that only the library can hold, so those
        steps keep their weights inside, and a one-row step that cannot be built apart (its kernels turned out to
        need opaque weights) is built again with them inside."""
        step = _ExportedStep(self, cache, batch)
        settings = _uncached_under_caps(self.inductor_settings(batch))
        settings.pop("cpp_wrapper")  # AOTInductor's wrapper is C++ anyway
        # The export sees fake tensors only: the cache it traces over is untouched.
        with (
            torch.no_grad(),
            torch._dynamo.config.patch(capture_scalar_outputs=True),
            torch._inductor.config.patch(settings),
        ):
            program = torch.export.export(step, (inputs[0], inputs[1], inputs[2:]), strict=False)
            if batch == 1:
                try:
                    with torch._inductor.config.patch(WEIGHTS_APART):
                        torch._inductor.aoti_compile_and_package(program, package_path=path)
                    return
                except Exception:  # an opaque weight, or AOTInductor's own failure to write them apart
                    pass
            torch._inductor.aoti_compile_and_package(program, package_path=path)

    def _say(self, line: str) -> None:
        if self.announce is not None:
            self.announce(line)


class _ExportedStep(torch.nn.Module):
    """The step as `torch.export` takes it: a module holding the model the step runs (`model_for`, whose weights
    freezing makes constants) called with the token, its position and the cache's tensors."""

    def __init__(self, decoder: CompiledStep, cache, batch: int):
        super().__init__()
        self.model = decoder.model_for(batch)
        self._decoder, self._cache = decoder, cache

    def forward(self, token, position, state):
        return self._decoder._forward_one(token, position, self._decoder._cache_over(self._cache, position, state))


def _uncached_under_caps(settings: dict) -> dict:
    """`settings` with inductor's on-disk caches of graphs and of autotuning times turned off where the environment
    caps the CPU's kernels (`cpu_caps`). Both leave the caps out of their keys: under a cap the graph cache would
    load the kernels an uncapped process built (AVX-512 ones under ATEN_CPU_CAPABILITY=avx2), and autotuning would
    weigh an ATen kernel's time taken under one cap against a template's taken under another, and pick by that; an
    uncapped process would read what a capped one wrote. Packages are keyed by the caps (`cpu_material`)."""
    if cpu_caps():
        return {**settings, "fx_graph_cache": False, "autotune_local_cache": False}
    return settings


def _exportable(model) -> bool:
    """Plain tensors only: torchao's tensor subclasses (int8 weights by int8 activations) do not export."""
    return plain_weights(model)


def _named_tensors(model):
    """Every parameter and buffer under each of its names (a tied weight under both)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _cache_positions(inputs) -> int:
    return max(t.shape[-2] for t in inputs[2:] if t.dim() >= 4)


class CompiledDecoder(CompiledStep):
    """`generate` for unpadded prompts, with the decode step compiled."""

    def __init__(self, model, compile: bool = True, cache_dir=None, announce=None):
        super().__init__(model, compile, cache_dir, announce)
        self._cache: StaticCache | None = None
        self._preparing: threading.Thread | None = None

    def _cache_state(self, cache):
        return [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]

    def _cache_over(self, cache, position, state):
        view = copy.copy(cache)
        view.layers = []
        for index, layer in enumerate(cache.layers):
            layer = copy.copy(layer)
            layer.keys, layer.values, layer.cumulative_length = state[3 * index : 3 * index + 3]
            view.layers.append(layer)
        return view

    def _example(self, batch, needed):
        cache = self._fresh_cache(batch, needed)
        return torch.zeros(batch, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), cache

    def prepare(self, batch: int = 1, needed: int = 1, background: bool = False) -> None:
        """Loads (or builds) the step for `batch` rows and a cache of `needed` positions now rather than at the first
        reply of that shape; `background`: in a thread, which the next `generate` waits for (the chat command
        compiles while the user types the first message). A step that cannot be packaged (a model holding tensor
        subclasses other than `quantize_weights_int8`'s) is compiled by torch.compile here all the same; the step
        runs once, on the cache the next reply of that shape reuses."""
        if not self.compiled:
            return
        if background:
            self._preparing = threading.Thread(
                target=self.prepare, args=(batch, needed), name=PREPARE_THREAD, daemon=True
            )
            self._preparing.start()
            return
        self.prompt_model(2)  # fbgemm's packed weights, where prompts multiply through them, made now
        token, position, cache = self._example(batch, needed)
        with torch.no_grad(), self._step_kernel():
            self._compiled_logits(token, position, cache)

    def wait_prepared(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _forward_one(self, token, position, cache):  # token [B, 1], position [1]
        out = self.model_for(token.shape[0])(input_ids=token, position_ids=position[None], cache=cache, use_cache=True)
        return out.logits[:, -1]  # [B, V]

    def _fresh_cache(self, batch: int, needed: int) -> StaticCache:
        length = cache_length(needed)
        if (
            self._cache is not None
            and self._cache.layers[0].max_cache_len == length
            and self._cache.layers[0].keys.shape[0] == batch
        ):
            for layer in self._cache.layers:
                zero_again(layer.keys)
                zero_again(layer.values)
                layer.cumulative_length.zero_()
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
        # Keys and values resident only as far as they are written (a reply holds what it wrote, not the whole
        # bucket), and not marked as static addresses as StaticCache marks them (for CUDA graphs): freezing would
        # fold them into the graph as constants, so in-place cache updates would write to a copy.
        for layer in cache.layers:
            layer.keys = lazy_zeros(layer.keys.shape, layer.keys.dtype, layer.keys.device)
            layer.values = lazy_zeros(layer.values.shape, layer.values.dtype, layer.values.device)
            for tensor in (layer.keys, layer.values, layer.cumulative_length):
                tensor.__dict__.pop("_dynamo_static_input_type", None)
        trim_heap()  # the zeros StaticCache allocated, freed into the heap
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
        self.wait_prepared()  # the step and the cache it was prepared on are this thread's from here on
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

        prompt = self.prompt_model(input_ids.numel())
        logits = prompt(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
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
