"""What the benchmark measures: its settings, the rows of both tables (id, shape, kind), the model sizes they run
at, the measured rows they become, and the selection of rows by id or glob pattern."""

import fnmatch
import statistics
from dataclasses import dataclass, field

EQUAL_TOLERANCE = 0.03  # a ratio within 3% of 1.0 counts as equal
TABLES = ("main", "peers", "all", "data")


# ----------------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------------


@dataclass
class BenchmarkSettings:
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    quick: bool = False  # tiny shapes, one repeat: a smoke test of every code path, numbers meaningless
    rows: list = field(default_factory=list)  # glob patterns over row ids; empty = all rows
    repeats: int | None = None  # timed repeats per model (default: 4, decode 2, quick 1)
    warmup: int | None = None  # untimed runs per model first (default: 1, train 2; at least 1)
    compile: str = "auto"  # "auto" (on for cuda, off for cpu) | "on" | "off"
    attn_implementation: str = "sdpa"  # or "flash_attention_2" on cuda where the package is installed
    profile: list = field(default_factory=list)  # glob patterns over row ids: log a torch.profiler table of each
    seed: int = 0
    command: str = ""  # the command line, recorded in the report
    table: str = "main"  # "main" (vs transformers) | "peers" (llama.cpp, padding-free SFT) | "all" | "data"


def row_matches(row_id, patterns):
    return any(fnmatch.fnmatch(row_id, p) or p in row_id for p in patterns)


def select_workloads(workloads, patterns):
    if not patterns:
        return workloads
    chosen = [w for w in workloads if row_matches(w.row_id, patterns)]
    if not chosen:
        raise ValueError(f"--rows {patterns} match no row. Rows: {', '.join(w.row_id for w in workloads)}")
    return chosen


# ----------------------------------------------------------------------------------------------------------
# The main table: MiniMind against transformers' Qwen3 / Qwen3-MoE
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One row to measure: what runs, at which shape."""

    row_id: str
    shape: str  # key into the shape table
    kind: str  # "train" | "prefill" | "decode"
    batch: int
    seq_len: int  # train/prefill: tokens per sequence; decode: prompt length
    new_tokens: int = 0  # decode only
    dtype: str = "fp32"  # train: fp32 or bf16 (autocast); prefill/decode: the weights' dtype
    cache: str = "dynamic"  # decode: "dynamic" | "static"
    compile: bool = False  # decode: let generate torch.compile the forward (static cache only)


@dataclass
class Row:
    workload: Workload
    ours_seconds: list
    native_seconds: list
    tokens: int  # tokens processed (train/prefill) or generated (decode) per run
    flops: float  # model FLOPs per run (matmuls + attention scores)
    peak_ours: int | None = None  # bytes above the pre-run baseline
    peak_native: int | None = None
    kv_bytes: int | None = None  # measured from our cache's tensors
    kv_expected: int | None = None  # 2 x layers x tokens x kv_heads x head_dim x dtype bytes
    note: str = ""
    skipped: str = ""  # why the row did not run

    @property
    def ratios(self):
        """Paired native/ours time ratios: > 1 means ours is faster."""
        return [n / o for o, n in zip(self.ours_seconds, self.native_seconds)]

    @property
    def ratio(self):
        return statistics.median(self.ratios)

    def tokens_per_second(self, seconds):
        return self.tokens / statistics.median(seconds)

    @property
    def verdict(self):
        low, high = min(self.ratios), max(self.ratios)
        if self.ratio >= 1.0 + EQUAL_TOLERANCE:
            verdict = "faster"
        elif self.ratio >= 1.0 - EQUAL_TOLERANCE:
            verdict = "equal (within 3%)"
        else:
            verdict = "BELOW"
        # Repeats landing on both sides of 1.0: the difference is smaller than the machine's noise.
        return verdict + (", noise-bound" if low < 1.0 < high else "")


def model_shapes(quick):
    """Named configs. Full: the 64M default and a 512-wide model; quick: the test suite's tiny sizes."""
    if quick:
        tiny = dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_theta=10000.0,
        )
        moe = dict(tiny, use_moe=True, num_experts=4, moe_intermediate_size=96)
        return {
            "64M": tiny,
            "small": dict(tiny, hidden_size=32),
            "moe-top1": dict(moe, num_experts_per_tok=1),
            "moe-top2": dict(moe, num_experts_per_tok=2),
        }
    # MoE: the small shape with 4 experts the size of its dense MLP (active FLOPs at top-1 = the dense model).
    moe = dict(hidden_size=512, use_moe=True, num_experts=4)
    return {
        "64M": {},
        "small": dict(hidden_size=512),
        "moe-top1": dict(moe, num_experts_per_tok=1),
        "moe-top2": dict(moe, num_experts_per_tok=2),
    }


def default_workloads(quick, device_type):
    """Every row of the table. B x T are sized for a short run on a 2-core CPU (docs/performance.md gives the
    time); on a GPU the same rows run with larger batches."""
    gpu = device_type == "cuda"
    if quick:
        train_bt, prefill_t, prompt, new = (2, 16), 32, 8, 4
    else:
        train_bt, prefill_t, prompt, new = ((8, 512) if gpu else (2, 128)), 512, 32, 128
    decode_dtype = "bf16" if gpu else "fp32"
    rows = []
    for shape in ("64M", "small"):
        for dtype in ("fp32", "bf16"):
            rows.append(Workload(f"train-{dtype}-{shape}", shape, "train", *train_bt, dtype=dtype))
    rows.append(Workload("prefill-512-64M", "64M", "prefill", 1, prefill_t, dtype=decode_dtype))
    for cache in ("dynamic", "static"):
        for batch in (1, 8):
            rows.append(
                Workload(
                    f"decode-{cache}-b{batch}-64M",
                    "64M",
                    "decode",
                    batch,
                    prompt,
                    new,
                    dtype=decode_dtype,
                    cache=cache,
                )
            )
    for shape in ("moe-top1", "moe-top2"):
        rows.append(Workload(f"train-fp32-{shape}", shape, "train", *train_bt, dtype="fp32"))
        rows.append(Workload(f"decode-dynamic-b1-{shape}", shape, "decode", 1, prompt, new, dtype=decode_dtype))
    # Last: its compile time is the one open-ended cost, and a run cut short keeps every row before it.
    rows.append(
        Workload(
            "decode-static-compile-b1-64M",
            "64M",
            "decode",
            1,
            prompt,
            new,
            dtype=decode_dtype,
            cache="static",
            compile=True,
        )
    )
    return rows


# ----------------------------------------------------------------------------------------------------------
# The peers table: llama.cpp on our own GGUF export, MiniMind's generate and compiled decoder, SFT, the server
# ----------------------------------------------------------------------------------------------------------
#
# A second table, run with `--table peers` (or `all`). The main table asks "is MiniMind as fast as the same
# model in transformers?"; this one asks "how far is it from the fastest CPU engine, and from what memory
# bandwidth allows?". Rows whose package is missing are kept in the table as skipped, with the reason.

PEER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # llama.cpp rows, one GGUF export each
PEER_MINIMIND = ("fp32", "bf16")
PEER_COMPILED = PEER_MINIMIND + ("int8",)  # int8: torchao weight-only int8 decoder layers, bf16 activations
PEER_BATCH = 8  # the batched decode rows: this many sequences, decoded together
PEER_PROMPT = "Once upon a time, a small language model lived in a quiet town. Every morning it"


@dataclass
class PeerWorkload:
    row_id: str
    kind: str  # "decode" | "prefill" | "sft" | "serve"
    engine: str  # "minimind" | "llama.cpp" | "minimind server"
    weights: str  # minimind: fp32 | bf16; llama.cpp: a GGUF outtype; sft: "padded" | "packed"
    batch: int = 1  # decode: sequences decoded together


@dataclass
class PeerRow:
    workload: PeerWorkload
    seconds: list = field(default_factory=list)
    tokens: int = 0  # generated (decode), prompt (prefill) or real non-pad tokens over all steps (sft)
    shape: str = ""
    weight_bytes: int | None = None  # bytes of the matrices one decode step reads
    same_tokens: tuple | None = None  # (leading tokens equal to MiniMind fp32's greedy ones, tokens compared)
    losses: list = field(default_factory=list)  # sft: the loss of each step
    timed_tokens: int | None = None  # sft: the real tokens of the timed steps (all but the first)
    note: str = ""
    skipped: str = ""

    @property
    def tokens_per_second(self):
        if self.timed_tokens is not None:
            return self.timed_tokens / sum(self.seconds)
        return self.tokens / statistics.median(self.seconds)


def peer_workloads():
    rows = [PeerWorkload(f"peers-decode-minimind-{w}", "decode", "minimind", w) for w in PEER_MINIMIND]
    rows += [
        PeerWorkload(f"peers-decode-minimind-compiled-{w}", "decode", "minimind compiled", w) for w in PEER_COMPILED
    ]
    rows += [PeerWorkload(f"peers-decode-llamacpp-{w}", "decode", "llama.cpp", w) for w in PEER_OUTTYPES]
    rows += [
        PeerWorkload(f"peers-decode-b{PEER_BATCH}-minimind-{w}", "decode", "minimind", w, PEER_BATCH)
        for w in PEER_MINIMIND
    ]
    rows += [
        PeerWorkload(f"peers-decode-b{PEER_BATCH}-minimind-compiled-{w}", "decode", "minimind compiled", w, PEER_BATCH)
        for w in PEER_COMPILED
    ]
    rows += [
        PeerWorkload(f"peers-decode-b{PEER_BATCH}-llamacpp-{w}", "decode", "llama.cpp", w, PEER_BATCH)
        for w in PEER_OUTTYPES
    ]
    rows += [PeerWorkload(f"peers-prefill-512-minimind-{w}", "prefill", "minimind", w) for w in PEER_MINIMIND]
    rows += [
        PeerWorkload(f"peers-prefill-512-minimind-compiled-{w}", "prefill", "minimind compiled", w)
        for w in PEER_COMPILED
    ]
    rows += [PeerWorkload(f"peers-prefill-512-llamacpp-{w}", "prefill", "llama.cpp", w) for w in PEER_OUTTYPES]
    rows += [PeerWorkload(f"peers-sft-512-{w}", "sft", "minimind", w) for w in ("padded", "packed", "padded-compiled")]
    rows += [
        PeerWorkload(f"peers-serve-{n}-clients{'' if w == 'fp32' else '-' + w}", "serve", "minimind server", w)
        for w in PEER_MINIMIND
        for n in (1, 8)
    ]
    rows += [
        PeerWorkload(
            f"peers-serve-{n}-clients-compiled{'' if w == 'fp32' else '-' + w}", "serve", "minimind server compiled", w
        )
        for w in PEER_MINIMIND
        for n in (1, 8)
    ]
    return rows


def peer_sizes(quick):
    """Model overrides and run lengths. The vocabulary is the bundled tokenizer's in both modes: a GGUF file
    carries its tokenizer, and llama.cpp checks it against the embedding rows."""
    if quick:
        tiny = dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        return dict(model=tiny, new_tokens=8, prefill=32, sft_batch=2, sft_steps=2, repeats=1, serve_requests=1)
    return dict(model={}, new_tokens=128, prefill=512, sft_batch=4, sft_steps=3, repeats=3, serve_requests=2)
