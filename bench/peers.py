"""The peers table: MiniMind's generate and compiled decoder against llama.cpp on the project's GGUF export
(decode at batch 1 and 8, prefill), each against the bandwidth floor of the bytes a decode step reads; padded
against padding-free SFT (bench.sft); the server under concurrent clients (bench.serve). A row whose package is
missing stays in the table, skipped, with the reason."""

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.llama_cpp import llama_cpp_missing, llama_cpp_row, llama_cpp_version
from bench.measure import DTYPES, copy_bandwidth, finish_details, machine_details, run_details, time_in_rounds
from bench.report import PeersReport
from bench.serve import measure_serve
from bench.sft import measure_sft
from bench.workloads import PEER_BATCH, PEER_PROMPT, PeerRow, peer_sizes, peer_workloads, select_workloads
from configuration_minimind import MiniMindConfig
from modeling_minimind import MiniMindForCausalLM

# ----------------------------------------------------------------------------------------------------------
# The bytes one decode step reads
# ----------------------------------------------------------------------------------------------------------

Q8_0_BLOCK, Q8_0_BLOCK_BYTES = 32, 34  # 32 int8 values and one float16 scale
BYTES_PER_ELEMENT = {"fp32": 4, "f32": 4, "bf16": 2, "f16": 2}


def decode_matrices(config):
    """(rows, row length) of every matrix one decode step reads: the decoder layers' projections and the LM
    head (tied to the embedding by default; the embedding itself only gives up one row per token). Norms are
    left out: a few KiB of vectors."""
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    if config.use_moe:
        raise ValueError("peers rows use the dense model")
    layer = [
        (q_out, config.hidden_size),
        (kv_out, config.hidden_size),
        (kv_out, config.hidden_size),
        (config.hidden_size, q_out),
        (config.intermediate_size, config.hidden_size),
        (config.intermediate_size, config.hidden_size),
        (config.hidden_size, config.intermediate_size),
    ]
    return layer * config.num_hidden_layers + [(config.vocab_size, config.hidden_size)]


def matrix_bytes(rows, row_length, weights):
    """Bytes of one matrix stored as `weights`. q8_0 packs each row in blocks of 32 values (34 bytes); the
    export stores a matrix whose rows are not a multiple of 32 in f16, as llama.cpp's converter does. int8: one
    byte per value and a float32 scale per row (torchao's layout)."""
    if weights == "int8":
        return rows * row_length + rows * 4
    if weights == "q8_0":
        if row_length % Q8_0_BLOCK:
            return rows * row_length * 2
        return rows * row_length // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
    return rows * row_length * BYTES_PER_ELEMENT[weights]


def weight_bytes_per_token(config, weights):
    # MiniMind's int8 path quantizes the LM head as well as the decoder layers, as q8_0 files do.
    return sum(matrix_bytes(rows, length, weights) for rows, length in decode_matrices(config))


# ----------------------------------------------------------------------------------------------------------
# The shared model and MiniMind's decode paths
# ----------------------------------------------------------------------------------------------------------


def int8_missing():
    """Why the int8 rows cannot run here, or "" when they can."""
    try:
        import torchao  # noqa: F401
    except ImportError as error:
        return f"torchao not installed ({error}); pip install 'minimind[int8]'"
    return ""


def leading_equal(a, b):
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _minimind_greedy(model, ids, new_tokens):
    """The new tokens of each row of `ids` ([B, T], unpadded), greedy with eos ignored."""
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            disable_compile=True,
        )
    return out[:, ids.shape[1] :].tolist()


class PeerContext:
    """What the peers rows share: one random-init model saved with the bundled tokenizer, its GGUF exports,
    the prompt and the fp32 greedy tokens every other path is compared with."""

    def __init__(self, settings, workdir, threads, log):
        from minimind.export import copy_tokenizer_files

        self.settings, self.workdir, self.threads, self.log = settings, workdir, threads, log
        self.sizes = peer_sizes(settings.quick)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.tokenizer_dir = os.path.join(root, "tokenizer")
        self.sft_data = os.path.join(root, "data", "sft.jsonl")
        torch.manual_seed(settings.seed)
        model = MiniMindForCausalLM(MiniMindConfig(**self.sizes["model"]))
        self.model_dir = os.path.join(workdir, "model")
        model.save_pretrained(self.model_dir)
        copy_tokenizer_files(self.tokenizer_dir, self.model_dir)
        self.config = model.config
        del model
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.prompt_ids = self.tokenizer(PEER_PROMPT)["input_ids"]
        generator = torch.Generator().manual_seed(settings.seed)
        self.prefill_ids = torch.randint(3, self.config.vocab_size, (1, self.sizes["prefill"]), generator=generator)[
            0
        ].tolist()
        # The batched rows' prompts: as long as the peer prompt, so that no row is padded.
        self.batch_prompts = torch.randint(
            3, self.config.vocab_size, (PEER_BATCH, len(self.prompt_ids)), generator=generator
        ).tolist()
        self._models, self._ggufs, self._references = {}, {}, {}

    @property
    def repeats(self):
        """Timed rounds of the decode, prefill and serve rows: --repeats, else this mode's default."""
        return self.settings.repeats or self.sizes["repeats"]

    def minimind(self, weights):
        if weights not in self._models:
            from minimind.decode import int8_activations_dtype

            dtype = DTYPES[weights] if weights != "int8" else getattr(torch, int8_activations_dtype())
            model = MiniMindForCausalLM.from_pretrained(
                self.model_dir,
                dtype=dtype,
                attn_implementation=self.settings.attn_implementation,
            ).eval()
            if weights == "int8":
                from minimind.decode import quantize_weights_int8

                quantize_weights_int8(model)
            self._models[weights] = model
        return self._models[weights]

    def gguf(self, outtype):
        from minimind.export import export_gguf

        if outtype not in self._ggufs:
            self._ggufs[outtype] = export_gguf(
                self.model_dir,
                os.path.join(self.workdir, f"model-{outtype}.gguf"),
                self.tokenizer_dir,
                outtype=outtype,
            )
        return self._ggufs[outtype]

    def prompts(self, batch):
        return [self.prompt_ids] if batch == 1 else self.batch_prompts[:batch]

    def reference(self, batch):
        """MiniMind fp32's greedy tokens for the batch's prompts: the plain path every other one is checked
        against."""
        if batch not in self._references:
            ids = torch.tensor(self.prompts(batch))
            self._references[batch] = _minimind_greedy(self.minimind("fp32"), ids, self.sizes["new_tokens"])
        return self._references[batch]


FP32_PRODUCTS = {
    "plain": "unpacked one-row products",
    "mkl": "MKL-packed weights",
    "onednn": "oneDNN-packed weights",
    "template": "inductor's C++ GEMM kernels",
    "sums": "products as sums over blocks of weight rows",
}
TIED_HEAD_SUMS = ", the tied head as sums over the embedding's rows"


def _compiled_decode(model, ids, new, weights, compile=True):
    """MiniMind's fast decode path (`minimind.decode.CompiledDecoder`, what `minimind-chat` uses): the greedy
    decode function, and the row's note from its tokens: the compile time and the tokens shared with plain
    `generate` at the same precision. `compile=False`: the same decoder with its steps run eagerly."""
    from minimind.decode import GROUPED_QUERY_SDPA, CompiledDecoder, SixteenBitProducts, fp32_product_kernel
    from minimind.decode.fbgemm import Float16RowsProduct
    from minimind.decode.int8 import Int8RowsProduct, Int8RowSums

    decoder = CompiledDecoder(model, compile=compile)

    @torch.no_grad()
    def decode():
        return decoder.generate(ids, max_new_tokens=new)[:, ids.shape[1] :].tolist()

    def describe(tokens):
        plain = _minimind_greedy(model, ids, new)
        shared = sum(leading_equal(a, b) for a, b in zip(tokens, plain))
        settings = decoder.inductor_settings(ids.shape[0])
        gemms = settings["max_autotune"] and "ATEN" in settings["max_autotune_gemm_backends"]
        step_model = decoder.model_for(ids.shape[0])
        sums = settings["post_grad_custom_pre_pass"]
        tied = model.config.tie_word_embeddings
        if any(isinstance(module, Int8RowSums) for module in step_model.modules()):
            products, gemms = "int8 values widened in float32 sums, four to a word", False
        elif any(isinstance(module, Int8RowsProduct) for module in step_model.modules()):
            products, gemms = "7-bit activations per row through fbgemm", False
        elif decoder.dtype == torch.float32:
            products = FP32_PRODUCTS[fp32_product_kernel(ids.shape[0])]
            products += TIED_HEAD_SUMS if tied and fp32_product_kernel(ids.shape[0]) == "template" else ""
        elif any(isinstance(module, Float16RowsProduct) for module in step_model.modules()):
            products, gemms = "16-bit weights as float16 through fbgemm", False
        elif isinstance(sums, SixteenBitProducts) and sums.tied_head_only:
            products = FP32_PRODUCTS["template"] + (TIED_HEAD_SUMS if tied else "")
        elif isinstance(sums, SixteenBitProducts):
            products, gemms = FP32_PRODUCTS["sums"], False  # no product left to tune
        elif step_model is decoder.rows_model:
            products = "prepacked weights, 8-bit activations per row"
        else:
            products = "prepacked weights"
        products += ", autotuned GEMMs" if gemms else ""
        attention = (
            ", grouped-query attention over the written cache" if decoder.step_attention == GROUPED_QUERY_SDPA else ""
        )
        prompt_products = _prompt_products(decoder, ids.numel())
        prompt = f"; the prompt's {prompt_products}" if prompt_products else ""
        frozen = "with freezing, merged projections" if settings["freezing"] else "without freezing"
        compiled = (
            f"torch.compile {frozen}, {products}{attention}, compiled in {decoder.compile_seconds:.0f} s{prompt}"
            if compile
            else f"steps run eagerly (quick mode){attention}{prompt}"
        )
        return (
            f"CompiledDecoder: static cache, {compiled}; greedy tokens = plain {weights} generate: "
            f"{shared} / {sum(map(len, plain))}"
        )

    return decode, describe


def _compiled_prompt(model, tokens):
    """What `minimind.decode.CompiledDecoder` runs a prompt of `tokens` tokens through (eagerly: prompts are not
    compiled), and the row's note naming its products."""
    from minimind.decode import CompiledDecoder

    decoder = CompiledDecoder(model, compile=False, cache_dir=False)
    products = _prompt_products(decoder, tokens) or "the model's own products"
    note = f"CompiledDecoder's prompt: forward with {products}, logits of the last position"
    return decoder.prompt_model(tokens), note


def _prompt_products(decoder, tokens):
    """The products a prompt of `tokens` tokens takes in `decoder` where they are not the model's own, else None."""
    from minimind.decode import OneDnnLinear

    forward = decoder.prompt_model(tokens)
    if forward is decoder.model:
        return None
    if any(isinstance(module, OneDnnLinear) for module in forward.modules()):
        return "fp32 products through oneDNN"
    return "products through fbgemm"


# ----------------------------------------------------------------------------------------------------------
# Decode and prefill rows, timed together in rounds
# ----------------------------------------------------------------------------------------------------------


@dataclass
class PreparedPeer:
    """A decode or prefill row ready for its timed rounds: `run` has run once (compiled, warmed up), `close`
    lets go of its engine once every round is over."""

    row: PeerRow
    run: Callable
    close: Callable


def prepare_peer(w, ctx):
    """A decode or prefill row's run, its first tokens checked against MiniMind fp32's; a skipped row as a
    `PeerRow` with its reason."""
    sizes = ctx.sizes
    row = PeerRow(w)
    new, prompt, prompts = sizes["new_tokens"], len(ctx.prompt_ids), ctx.prompts(w.batch)
    row.shape = f"{w.batch} x {prompt} (+{new})" if w.kind == "decode" else f"1 x {sizes['prefill']}"
    row.tokens = new * w.batch if w.kind == "decode" else sizes["prefill"]
    close = lambda: None  # noqa: E731
    if w.engine == "llama.cpp":
        missing = llama_cpp_missing()
        if missing:
            row.skipped = missing
            return row
        run, note, close = llama_cpp_row(w, ctx)
        describe = lambda tokens: note  # noqa: E731
    else:
        if w.weights == "int8" and int8_missing():
            row.skipped = int8_missing()
            return row
        model = ctx.minimind(w.weights)
        if w.kind == "prefill":
            ids = torch.tensor([ctx.prefill_ids])
            forward, note = model, "forward, logits of the last position"
            if w.engine == "minimind compiled":
                forward, note = _compiled_prompt(model, ids.numel())

            @torch.no_grad()
            def run():
                forward(input_ids=ids, use_cache=True, logits_to_keep=1)

            describe = lambda tokens: note  # noqa: E731
        elif w.engine == "minimind compiled":
            # quick: only fp32 steps are compiled (bf16 and int8 graphs take far longer to compile, and
            # tests/decode/test_kernels.py checks their compiled steps); the others run the same decoder with
            # eager steps
            compile = not ctx.settings.quick or w.weights == "fp32"
            run, describe = _compiled_decode(model, torch.tensor(prompts), new, w.weights, compile)
        else:
            ids = torch.tensor(prompts)
            run = lambda: _minimind_greedy(model, ids, new)  # noqa: E731
            describe = lambda tokens: "generate, dynamic cache"  # noqa: E731
    try:
        tokens = run()  # the compiled path compiles here
        row.note = describe(tokens)
    except BaseException:
        close()
        raise
    if w.kind == "decode":
        row.weight_bytes = weight_bytes_per_token(ctx.config, w.weights) // w.batch
        reference = ctx.reference(w.batch)
        row.same_tokens = (sum(leading_equal(a, b) for a, b in zip(tokens, reference)), sum(map(len, reference)))
    return PreparedPeer(row, run, close)


# ----------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------


def run_peers(settings, threads, log=print, on_row=None):
    """Every selected peers row: the decode and prefill rows built first and timed in rounds, then the SFT rows,
    then the serve rows, one server per weights and engine. `on_row(report)` sees the report so far."""
    started = time.perf_counter()
    workloads = select_workloads(peer_workloads(), settings.rows)
    machine, details = machine_details(), run_details(torch.device("cpu"))
    details["llama-cpp-python"] = llama_cpp_version()
    bandwidth = copy_bandwidth(settings.quick)
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    measured = {}

    def report_progress():
        if on_row and len(measured) < len(workloads):
            done = [measured[w.row_id] for w in workloads if w.row_id in measured]
            partial = dict(details, partial=f"{len(done)} of {len(workloads)} rows")
            on_row(PeersReport(partial, bandwidth, done, settings, machine=machine))

    with tempfile.TemporaryDirectory(prefix="minimind-peers-") as workdir:
        ctx = PeerContext(settings, workdir, threads, log)
        prepared = []
        try:
            for w in workloads:
                if w.kind in ("decode", "prefill"):
                    row = prepare_peer(w, ctx)
                    if isinstance(row, PreparedPeer):
                        prepared.append(row)
                        row = row.row
                    measured[w.row_id] = row
        except BaseException:
            for p in prepared:
                p.close()
            raise
        time_in_rounds(prepared, ctx.repeats, log)
        report_progress()
        for w in workloads:
            if w.kind == "sft":
                measured[w.row_id] = measure_sft(w, ctx)
                report_progress()
        servers = {}  # the serve rows of each (weights, engine), in table order
        for w in workloads:
            if w.kind == "serve":
                servers.setdefault((w.weights, w.engine), []).append(w)
        for group in servers.values():
            measured.update((row.workload.row_id, row) for row in measure_serve(group, ctx))
            report_progress()
    rows = [measured[w.row_id] for w in workloads]
    bandwidth = max(bandwidth, copy_bandwidth(settings.quick))
    return PeersReport(finish_details(details, started), bandwidth, rows, settings, machine=machine)
