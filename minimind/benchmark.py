"""MiniMind against transformers' own Qwen3 / Qwen3-MoE: same config, same weights, same process, same run.

The machine this runs on is usually shared, so absolute numbers drift from run to run. What counts is the
ratio: every repeat times ours and native back to back (alternating which goes first), and a row's ratio is
the median of those paired ratios. Each row also reports achieved GFLOP/s against a matmul ceiling measured
in the same run, peak memory, and for decode rows the KV cache's bytes, checked against
2 x layers x tokens x kv_heads x head_dim x dtype bytes.

Entry point: `run_benchmark(BenchmarkSettings(...))` -> `BenchmarkReport` (rows + markdown). With
`table="peers"` it measures the second table instead (`PeersReport`): llama.cpp on the project's GGUF export,
padded vs padding-free SFT and the server under concurrent clients, each row skipped with its reason when a
package is missing.
"""

import contextlib
import copy
import ctypes
import ctypes.util
import datetime
import fnmatch
import itertools
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from configuration_minimind import MiniMindConfig
from minimind.export import to_qwen3_model
from modeling_minimind import MiniMindForCausalLM

EQUAL_TOLERANCE = 0.03  # a ratio within 3% of 1.0 counts as equal


# ----------------------------------------------------------------------------------------------------------
# Settings and rows
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
    table: str = "main"  # "main" (vs transformers) | "peers" (llama.cpp, padding-free SFT) | "all"


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


# ----------------------------------------------------------------------------------------------------------
# Shapes and workloads
# ----------------------------------------------------------------------------------------------------------


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
    """Every row of the table. B x T are sized for a 2-core CPU run of about ten minutes in all; on a GPU
    the same rows run with larger batches."""
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
# Identical models: ours and transformers' Qwen3 / Qwen3-MoE
# ----------------------------------------------------------------------------------------------------------


def build_pair(shape_overrides, device, dtype, attn_implementation, seed):
    """Ours and native with the same weights, on `device` in `dtype`, in eval mode.

    Both are new models loaded from one initialised source, built the same way. On a CPU the allocation history
    of a model's weights moves its speed by several percent: a model still holding the tensors it was
    initialised in ran 7-11% slower than a copy of itself. Ours is built first, which if anything favours native.
    """
    torch.manual_seed(seed)
    config = MiniMindConfig(**shape_overrides, attn_implementation=attn_implementation)
    source = MiniMindForCausalLM(config)
    ours = MiniMindForCausalLM(config)
    ours.load_state_dict(source.state_dict())
    native = to_qwen3_model(source)  # the export's converter: strict load, experts fused for Qwen3-MoE
    native.set_attn_implementation(attn_implementation)
    del source
    return ours.to(device, dtype).eval(), native.to(device, dtype).eval()


# ----------------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------------


def matmul_params_per_token(config):
    """Weights each token multiplies through in the decoder layers (active experts only)."""
    attn = config.hidden_size * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = 0
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            mlp = (
                config.hidden_size * config.num_experts
                + config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size
            )
        else:
            mlp = 3 * config.hidden_size * config.intermediate_size
        total += attn + mlp
    return total


def forward_flops(config, batch, q_len, past, logit_positions):
    """FLOPs of one forward: 2 per multiply-add in the projections, the LM head on `logit_positions` positions
    per row, and causal attention (q.k and p.v over the keys each query sees)."""
    linear = 2 * batch * q_len * matmul_params_per_token(config)
    head = 2 * batch * logit_positions * config.hidden_size * config.vocab_size
    keys_seen = q_len * past + q_len * (q_len + 1) // 2  # summed over the new queries
    attention = 4 * batch * keys_seen * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    return linear + head + attention


def workload_flops(config, w):
    if w.kind == "train":  # forward + backward (twice the forward)
        return 3 * forward_flops(config, w.batch, w.seq_len, 0, w.seq_len)
    if w.kind == "prefill":
        return forward_flops(config, w.batch, w.seq_len, 0, 1)
    # decode: the prompt once, then one token per step for the remaining new tokens
    total = forward_flops(config, w.batch, w.seq_len, 0, 1)
    for step in range(1, w.new_tokens):
        total += forward_flops(config, w.batch, 1, w.seq_len + step - 1, 1)
    return total


# ----------------------------------------------------------------------------------------------------------
# Device helpers: sync, peak memory, matmul ceiling
# ----------------------------------------------------------------------------------------------------------


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device. Fix: run on a GPU machine or --device cpu.")
    return device


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_probe():
    """A function returning the bytes malloc has handed out and not got back (glibc's mallinfo2: all arenas
    plus mmapped blocks; torch's CPU tensors live there), or None where that is unavailable. Unlike resident
    memory it falls when tensors are freed, so a peak measured with it is not hidden by cached free pages."""
    try:
        mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2

    def in_use():
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


@contextlib.contextmanager
def peak_memory(device, result):
    """Peak bytes above the starting level while the block runs, written to result["peak"].

    CUDA: the caching allocator's exact peak. CPU: malloc's bytes in use, sampled every half millisecond by a
    thread (the CPU allocator keeps no peak statistics); None without glibc."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield
        synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - start
        return
    in_use = _heap_probe()
    if in_use is None:
        yield
        result["peak"] = None
        return
    start = in_use()
    peak = [start]
    done = threading.Event()

    def sample():
        while not done.wait(0.0005):
            peak[0] = max(peak[0], in_use())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        result["peak"] = max(peak[0], in_use()) - start


def matmul_ceiling(device, dtype, size, repeats=3):
    """Best GFLOP/s of one square matmul: the roof that model rows are compared with."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernel selection, page faults, thread-pool start
        a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def machine_details(device):
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        cpu = names[0] if names else cpu
    import transformers

    details = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):
        details["load average at start (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return details


# ----------------------------------------------------------------------------------------------------------
# The timed work
# ----------------------------------------------------------------------------------------------------------

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_train_step(model, ids, device, dtype, moe):
    """One optimisation step (forward with labels, backward, AdamW, zero grads) as a closure."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    # Ours adds the load-balancing loss whenever labels are given; Qwen3-MoE only when asked.
    extra = {"output_router_logits": True} if moe else {}

    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_prefill(model, ids):
    @torch.no_grad()
    def prefill():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    return prefill


def generation_kwargs(w, compile_forward):
    from transformers import CompileConfig

    kwargs = dict(
        max_new_tokens=w.new_tokens,
        min_new_tokens=w.new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        disable_compile=not compile_forward,
    )
    if w.cache == "static":
        kwargs["cache_implementation"] = "static"
    if compile_forward:
        config = CompileConfig(fullgraph=False, dynamic=False)
        config._compile_all_devices = True  # generate only auto-compiles on accelerators; this opts CPU in
        kwargs["compile_config"] = config
    return kwargs


def make_decode(model, ids, w, compile_forward):
    kwargs = generation_kwargs(w, compile_forward)

    @torch.no_grad()
    def decode():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)

    return decode


def kv_cache_bytes(cache):
    """Bytes held by the cache's key and value tensors, summed over layers."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def expected_kv_bytes(config, w):
    """2 (K and V) x layers x tokens x kv_heads x head_dim x dtype bytes. Tokens per row: the prompt and every
    generated token but the last, which is never fed back; generate sizes a static cache to exactly that."""
    tokens = w.batch * (w.seq_len + w.new_tokens - 1)
    element = torch.tensor([], dtype=DTYPES[w.dtype]).element_size()
    return 2 * config.num_hidden_layers * tokens * config.num_key_value_heads * config.head_dim * element


def warm_up(fns, runs, device):
    """Untimed runs of each model; the last one runs under the memory probe and its output is returned (the
    decode rows check their KV cache on it)."""
    peaks, outputs = {}, {}
    for name, fn in fns.items():
        for _ in range(runs - 1):
            fn()
        result = {}
        with peak_memory(device, result):
            outputs[name] = fn()
        peaks[name] = result["peak"]
    return peaks, outputs


def alternating_rounds(items, repeats):
    """`items` once per round for `repeats` rounds, every other round backwards."""
    for round in range(repeats):
        yield from (items if round % 2 == 0 else items[::-1])


def race(fns, repeats, device):
    """Seconds per call for each model, interleaved (and the order alternated) so that both see the same
    machine load."""
    times = {name: [] for name in fns}
    for name, fn in alternating_rounds(list(fns.items()), repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times[name].append(time.perf_counter() - start)
    return times


def profile_table(fn, device, row_limit=15):
    """torch.profiler's op table for one call, most expensive first (device time on a GPU: kernels; CPU time
    otherwise). On CUDA, host syncs show up as cudaStreamSynchronize / cudaMemcpyAsync rows."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        fn()
        synchronize(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit)


def default_repeats(kind, quick):
    """Short runs repeated often beat long ones on a noisy machine; decode runs are the long ones."""
    if quick:
        return 1
    return 2 if kind == "decode" else 4


def measure(w, shape_overrides, settings, device, log):
    """Build the pair for one workload, warm up (taking peak memory and checking the KV cache), then time."""
    compile_forward = w.compile and _compile_enabled(settings, device)
    if w.compile and not compile_forward:
        return Row(
            w,
            [],
            [],
            0,
            0.0,
            skipped=(
                "torch.compile skipped on CPU (inductor compile time exceeds the run's budget; --compile on to try it)"
                if device.type == "cpu"
                else "--compile off"
            ),
        )
    weight_dtype = DTYPES[w.dtype] if w.kind != "train" else torch.float32
    ours, native = build_pair(shape_overrides, device, weight_dtype, settings.attn_implementation, settings.seed)
    config = ours.config
    generator = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(3, config.vocab_size, (w.batch, w.seq_len), generator=generator).to(device)

    if w.kind == "train":
        fns = {
            name: make_train_step(m, ids, device, w.dtype, config.use_moe)
            for name, m in (("ours", ours), ("native", native))
        }
    elif w.kind == "prefill":
        fns = {name: make_prefill(m, ids) for name, m in (("ours", ours), ("native", native))}
    else:
        fns = {name: make_decode(m, ids, w, compile_forward) for name, m in (("ours", ours), ("native", native))}

    # Training warms up twice: the first step allocates AdamW's state, the second shows the steady peak.
    warmup = max(1, settings.warmup if settings.warmup is not None else (2 if w.kind == "train" else 1))
    peaks, outputs = warm_up(fns, warmup, device)
    times = race(fns, settings.repeats or default_repeats(w.kind, settings.quick), device)
    if row_matches(w.row_id, settings.profile):
        for name, fn in fns.items():
            log(f"profile of {w.row_id}, {name}:\n{profile_table(fn, device)}")
    row = Row(
        w,
        times["ours"],
        times["native"],
        w.batch * (w.new_tokens if w.kind == "decode" else w.seq_len),
        workload_flops(config, w),
        peak_ours=peaks["ours"],
        peak_native=peaks["native"],
    )
    if w.kind == "decode":
        out = outputs["ours"]
        assert out.sequences.shape[1] == w.seq_len + w.new_tokens
        cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.x renamed the field
        row.kv_bytes, row.kv_expected = kv_cache_bytes(cache), expected_kv_bytes(config, w)
        assert row.kv_bytes == row.kv_expected, (
            f"{w.row_id}: KV cache holds {row.kv_bytes} bytes, expected {row.kv_expected} "
            f"(2 x layers x tokens x kv_heads x head_dim x dtype bytes)"
        )
    notes = []
    if w.kind == "decode":  # same length either way (min_new_tokens); same tokens says both computed alike
        same = torch.equal(outputs["ours"].sequences, outputs["native"].sequences)
        notes.append("same tokens as native" if same else "tokens differ from native (near-tie logits)")
    if config.use_moe:
        notes.append(f"native experts: {native.config._experts_implementation}")
    row.note = "; ".join(notes)
    log(
        f"{w.row_id}: ours {row.tokens_per_second(row.ours_seconds):.1f} tok/s, native "
        f"{row.tokens_per_second(row.native_seconds):.1f} tok/s, ratio {row.ratio:.3f}"
    )
    return row


def _compile_enabled(settings, device):
    return settings.compile == "on" or (settings.compile == "auto" and device.type == "cuda")


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------

TABLE_COLUMNS = [
    "row",
    "shape",
    "B x T (+new)",
    "dtype",
    "ours tok/s",
    "native tok/s",
    "ratio (min-max)",
    "verdict",
    "ours GFLOP/s (% of ceiling)",
    "peak mem ours / native",
    "KV cache bytes (= formula)",
    "notes",
]


@dataclass
class BenchmarkReport:
    details: dict
    ceilings: dict  # dtype name -> GFLOP/s
    rows: list
    settings: BenchmarkSettings
    peers: "PeersReport | None" = None  # the peers table, when the run measured both

    def table(self):
        lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
        for row in self.rows:
            lines.append("| " + " | ".join(_cells(row, self.ceilings)) + " |")
        return "\n".join(lines)

    def markdown(self):
        details = "\n".join(f"- {key}: {value}" for key, value in self.details.items())
        ceilings = ", ".join(f"{name} {value:.1f} GFLOP/s" for name, value in self.ceilings.items())
        mode = "quick mode: tiny shapes, numbers meaningless" if self.settings.quick else "full mode"
        command = self.settings.command or "python scripts/benchmark.py"
        return (
            f"# MiniMind vs transformers' Qwen3 / Qwen3-MoE\n\n"
            f"Generated by `{command}` ({mode}). Same config, same weights, same process; ours and "
            f"native interleaved on every repeat.\n\n"
            f"## Machine\n\n{details}\n- matmul ceiling measured in this run: {ceilings}\n\n"
            f"## Results\n\n{self.table()}\n\n## How to read it\n\n{REPORT_NOTES}"
            + (f"\n{self.peers.markdown()}" if self.peers is not None else "")
        )


REPORT_NOTES = """\
- ratio = native time / our time, the median over repeats of the paired (back-to-back) ratios; above 1.0
  MiniMind is faster. Within 3% of 1.0 counts as equal. "noise-bound": the repeats' ratios fall on both sides
  of 1.0, so the difference is below what this machine can resolve. tok/s are medians; on a shared machine
  they move from run to run, the ratios much less.
- tok/s: train and prefill count the B x T tokens processed, decode the B x 128 generated tokens (generate,
  greedy, prompt prefill included in the time).
- GFLOP/s: 2 FLOPs per multiply-add in every projection, the LM head (all positions in training, the last in
  prefill/decode) and causal attention; training counts 3x the forward. The share is of the best large matmul
  of that dtype measured in the same run (bf16 autocast rows against the bf16 matmul).
- peak mem: bytes above the level before one run (CUDA: the allocator's peak; CPU: malloc's bytes in use,
  sampled every 0.5 ms), taken on the last warm-up run; a training step's includes gradients and activations,
  not the weights or AdamW state allocated before it.
- KV cache bytes: summed over the cache's key and value tensors after generate, asserted equal to
  2 x layers x tokens x kv_heads x head_dim x dtype bytes, tokens = batch x (prompt + new - 1): the last
  generated token is never fed back, and generate sizes a static cache to the same length.
- MoE rows: both models compute the load-balancing loss in training (Qwen3-MoE is passed output_router_logits).
- The machine may be shared: other processes' work runs alongside (the load averages above show how much),
  which moves absolute numbers between runs but affects ours and native alike within a pair.
- torch threads below the core count: on a shared machine every multi-threaded op waits for its slowest worker,
  and a descheduled worker stalls it for a whole time slice; one thread gives stabler ratios.
"""


def _mib(value):
    if value is None:
        return "n/a"
    return f"{value / 2**20:.0f} MiB" if value >= 2**20 else f"{value / 2**10:.0f} KiB"


def _cells(row, ceilings):
    w = row.workload
    shape = f"{w.batch} x {w.seq_len}" + (f" (+{w.new_tokens})" if w.kind == "decode" else "")
    dtype = w.dtype + (" autocast" if w.kind == "train" and w.dtype == "bf16" else "")
    dtype += f", {w.cache} cache" if w.kind == "decode" else ""
    dtype += " + compile" if w.compile else ""
    if row.skipped:
        return [w.row_id, w.shape, shape, dtype, "-", "-", "-", "skipped", "-", "-", "-", row.skipped]
    gflops = row.flops / statistics.median(row.ours_seconds) / 1e9
    ceiling = ceilings[w.dtype]
    kv = (
        "-"
        if row.kv_bytes is None
        else (f"{row.kv_bytes:,} {'=' if row.kv_bytes == row.kv_expected else '!='} {row.kv_expected:,}")
    )
    ratios = row.ratios
    return [
        w.row_id,
        w.shape,
        shape,
        dtype,
        f"{row.tokens_per_second(row.ours_seconds):,.1f}",
        f"{row.tokens_per_second(row.native_seconds):,.1f}",
        f"{row.ratio:.3f} ({min(ratios):.2f}-{max(ratios):.2f})",
        row.verdict,
        f"{gflops:,.1f} ({100 * gflops / ceiling:.1f}%)",
        f"{_mib(row.peak_ours)} / {_mib(row.peak_native)}",
        kv,
        row.note,
    ]


@contextlib.contextmanager
def intra_op_threads(count):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_benchmark(settings, log=print, on_row=None):
    """Measure every selected row; `on_row(report)` sees the report so far after each row (a run that is cut
    short can still leave its table behind)."""
    device = resolve_device(settings.device)
    # Quick mode's tiny ops gain nothing from a second CPU thread, and on a shared machine every multi-threaded
    # op can stall on a descheduled worker: one thread keeps the smoke test fast.
    threads = 1 if settings.quick and device.type == "cpu" else torch.get_num_threads()
    if settings.table not in TABLES:
        raise ValueError(f"table must be one of {TABLES}, got {settings.table!r}")
    with intra_op_threads(threads):
        if settings.table == "main":
            return _run(settings, device, log, on_row)
        if settings.table == "peers":
            return run_peers(settings, threads, log, on_row)
        # Both tables: --rows may name rows of either, so only a pattern matching neither is an error.
        main_rows = [w.row_id for w in default_workloads(settings.quick, device.type)]
        peer_rows = [w.row_id for w in peer_workloads()]
        if settings.rows and not any(row_matches(r, settings.rows) for r in main_rows + peer_rows):
            raise ValueError(f"--rows {settings.rows} match no row. Rows: {', '.join(main_rows + peer_rows)}")
        report = None
        if not settings.rows or any(row_matches(r, settings.rows) for r in main_rows):
            report = _run(settings, device, log, on_row)
        if not settings.rows or any(row_matches(r, settings.rows) for r in peer_rows):
            peers = run_peers(settings, threads, log)
            if report is None:
                return peers
            report.peers = peers
        return report


def _run(settings, device, log, on_row):
    started = time.perf_counter()
    workloads = select_workloads(default_workloads(settings.quick, device.type), settings.rows)
    shapes = model_shapes(settings.quick)
    details = machine_details(device)
    size = 256 if settings.quick else (8192 if device.type == "cuda" else 2048)
    ceilings = {name: matmul_ceiling(device, dtype, size) for name, dtype in DTYPES.items()}
    log("matmul ceiling: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in ceilings.items()))
    rows = []
    for w in workloads:
        rows.append(measure(w, copy.deepcopy(shapes[w.shape]), settings, device, log))
        if on_row and len(rows) < len(workloads):
            on_row(
                BenchmarkReport(
                    dict(details, partial=f"{len(rows)} of {len(workloads)} rows"), ceilings, list(rows), settings
                )
            )
    # Measured again at the end and the better kept: a ceiling is the best the machine did in this run.
    ceilings = {name: max(value, matmul_ceiling(device, DTYPES[name], size)) for name, value in ceilings.items()}
    if hasattr(os, "getloadavg"):
        details["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    details["run time"] = f"{time.perf_counter() - started:.0f} s"
    return BenchmarkReport(details, ceilings, rows, settings)


# ----------------------------------------------------------------------------------------------------------
# Peers: llama.cpp on our own GGUF export, MiniMind's generate, padded vs padding-free SFT, the server
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
Q8_0_BLOCK, Q8_0_BLOCK_BYTES = 32, 34  # 32 int8 values and one float16 scale
BYTES_PER_ELEMENT = {"fp32": 4, "f32": 4, "bf16": 2, "f16": 2}
TABLES = ("main", "peers", "all")


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
    rows += [PeerWorkload(f"peers-prefill-512-llamacpp-{w}", "prefill", "llama.cpp", w) for w in PEER_OUTTYPES]
    rows += [PeerWorkload(f"peers-sft-512-{w}", "sft", "minimind", w) for w in ("padded", "packed", "padded-compiled")]
    rows += [
        PeerWorkload(f"peers-serve-{n}-clients{'' if w == 'fp32' else '-' + w}", "serve", "minimind server", w)
        for w in PEER_MINIMIND
        for n in (1, 8)
    ]
    rows += [
        PeerWorkload(f"peers-serve-{n}-clients-compiled", "serve", "minimind server compiled", "fp32") for n in (1, 8)
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
        return dict(
            model=tiny, new_tokens=8, prefill=32, sft_batch=2, sft_steps=2, repeats=1, serve_tokens=8, serve_requests=1
        )
    return dict(
        model={}, new_tokens=128, prefill=512, sft_batch=4, sft_steps=3, repeats=3, serve_tokens=64, serve_requests=2
    )


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
    *layers, head = decode_matrices(config)
    # MiniMind's int8 path quantizes the decoder layers only: the tied LM head stays bf16.
    return sum(matrix_bytes(rows, length, weights) for rows, length in layers) + matrix_bytes(
        *head, "bf16" if weights == "int8" else weights
    )


def gguf_matrix_bytes(path):
    """Bytes of the 2-D tensors stored in a GGUF file, read back from the file itself."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


def copy_bandwidth(quick, repeats=5):
    """Best bytes per second of one large tensor copy (read + write counted): the roof a decode step, which
    streams every weight once, can approach. Quick mode's buffer fits in cache, so its number is meaningless."""
    numel = (8 if quick else 64) * 2**20  # float32: 32 or 256 MiB
    src = torch.ones(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def amx_int8():
    if not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as info:
        return any(line.startswith("flags") and "amx_int8" in line.split() for line in info)


def llama_cpp_missing():
    """Why llama.cpp rows cannot run here, or "" when they can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama_cpp not installed ({error}); pip install llama-cpp-python"
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        return f"gguf not installed ({error}); pip install gguf"
    return ""


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


class _LlamaCpp:
    """One GGUF model in llama.cpp, driven token by token so that greedy decoding ignores eos exactly as
    generate(min_new_tokens=N) does."""

    def __init__(self, path, n_ctx, threads, extra_buffer_types=True):
        import llama_cpp
        import llama_cpp.llama

        # `Llama` does not expose llama.cpp's `use_extra_bufts` (the CPU backend's AMX and repacked layouts),
        # so the default parameters it starts from are adjusted for the one call.
        defaults = llama_cpp.llama.llama_cpp.llama_model_default_params

        def model_params():
            params = defaults()
            params.use_extra_bufts = extra_buffer_types
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
        try:
            self.llama = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=512,
                n_ubatch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        finally:
            llama_cpp.llama.llama_cpp.llama_model_default_params = defaults
        self.vocab = self.llama.n_vocab()
        self._batch_context = self._batch = None

    def _next_token(self):
        import numpy

        logits = numpy.ctypeslib.as_array(self.llama._ctx.get_logits(), shape=(self.vocab,))
        return int(logits.argmax())

    def greedy(self, ids, new_tokens):
        self.llama.reset()
        self.llama.eval(ids)
        out = []
        for step in range(new_tokens):
            out.append(self._next_token())
            if step + 1 < new_tokens:  # the last token is never fed back, as in generate
                self.llama.eval([out[-1]])
        return out

    def greedy_batch(self, prompts, new_tokens):
        """Greedy decoding of several sequences together: each step is one llama_decode over one new token of
        every sequence (llama.cpp's batched decoding, as its llama-batched example and server do)."""
        import llama_cpp
        import numpy

        if self._batch_context is None:
            params = llama_cpp.llama_context_params.from_buffer_copy(self.llama.context_params)
            params.n_seq_max, params.kv_unified = len(prompts), True
            params.n_ctx = len(prompts) * self.llama.n_ctx()
            params.n_batch = params.n_ubatch = max(params.n_batch, sum(map(len, prompts)))  # all prompts at once
            self._batch_context = llama_cpp.llama_init_from_model(self.llama._model.model, params)
            self._batch = llama_cpp.llama_batch_init(sum(map(len, prompts)), 0, len(prompts))
        context, batch = self._batch_context, self._batch
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)

        def decode(entries):  # (sequence, position, token, wants logits)
            batch.n_tokens = len(entries)
            for i, (sequence, position, token, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
                batch.seq_id[i][0] = sequence
            if llama_cpp.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed on the batched decode")
            return [
                int(numpy.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(context, i), shape=(self.vocab,)).argmax())
                for i, entry in enumerate(entries)
                if entry[3]
            ]

        next_tokens = decode(
            [(s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        )
        out = [[token] for token in next_tokens]
        for step in range(1, new_tokens):
            next_tokens = decode([(s, len(prompts[s]) + step - 1, seq[-1], True) for s, seq in enumerate(out)])
            for seq, token in zip(out, next_tokens):
                seq.append(token)
        return out

    def prefill(self, ids):
        self.llama.reset()
        self.llama.eval(ids)

    def close(self):
        import llama_cpp

        if self._batch_context is not None:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._batch_context)
        self.llama.close()


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
        self._models, self._ggufs, self._references, self._servers = {}, {}, {}, {}

    @property
    def repeats(self):
        """Timed rounds of the decode, prefill and serve rows: --repeats, else this mode's default."""
        return self.settings.repeats or self.sizes["repeats"]

    def minimind(self, weights):
        if weights not in self._models:
            model = MiniMindForCausalLM.from_pretrained(
                self.model_dir,
                dtype=DTYPES["bf16" if weights == "int8" else weights],
                attn_implementation=self.settings.attn_implementation,
            ).eval()
            if weights == "int8":
                from minimind.decode import quantize_weights_int8

                quantize_weights_int8(model)
            self._models[weights] = model
        return self._models[weights]

    def server(self, weights, engine):
        """The serving `Generator` for these weights and engine, shared by its rows (a compiled engine compiles
        its steps once, before its first row)."""
        if (weights, engine) not in self._servers:
            from minimind.chat import load_model_and_tokenizer
            from minimind.serving import Generator, ServerLimits

            model, tokenizer = load_model_and_tokenizer(
                self.model_dir, "cpu", {"fp32": "float32", "bf16": "bfloat16"}[weights]
            )
            new = self.sizes["serve_tokens"]
            # The paged engine sizes its KV cache for max_context x sequences: the model's own 32k context would
            # ask for gigabytes; the prompts here need a few hundred positions.
            # quick: the compiled engine's steps run eagerly (its graphs are tested against generate elsewhere)
            generator = Generator(
                model,
                tokenizer,
                "peers",
                engine=engine,
                compile=not self.settings.quick,
                limits=ServerLimits(
                    max_context=256, max_tokens=new, default_max_tokens=new, max_concurrent_requests=8, max_batch=8
                ),
            )
            if engine == "compiled" and not self.settings.quick:
                self.log(
                    f"serve {weights} compiled: steps compiled for batches {generator.engine.batch_sizes} in "
                    f"{generator.engine.warm_up():.0f} s"
                )
            self._servers[weights, engine] = generator
        return self._servers[weights, engine]

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
        # llama.cpp's AMX-INT8 kernels for q8_0 segfault (ggml-org/llama.cpp#20824): on such a CPU q8_0 runs
        # with the CPU backend's extra buffer types off, on its AVX-512 kernels.
        plain_buffers = w.weights == "q8_0" and amx_int8()
        engine = _LlamaCpp(
            ctx.gguf(w.weights),
            n_ctx=max(prompt + new, sizes["prefill"]) + 16,
            threads=ctx.threads,
            extra_buffer_types=not plain_buffers,
        )
        close = engine.close
        if w.kind == "prefill":
            run = lambda: engine.prefill(ctx.prefill_ids)  # noqa: E731
        elif w.batch == 1:
            run = lambda: [engine.greedy(ctx.prompt_ids, new)]  # noqa: E731
        else:
            run = lambda: engine.greedy_batch(prompts, new)  # noqa: E731
        note = f"n_threads {ctx.threads}" + (
            "; extra buffer types off (AMX-INT8 q8_0 kernels segfault: ggml-org/llama.cpp#20824)"
            if plain_buffers
            else ""
        )
        describe = lambda tokens: note  # noqa: E731
    else:
        if w.weights == "int8" and int8_missing():
            row.skipped = int8_missing()
            return row
        model = ctx.minimind(w.weights)
        if w.kind == "prefill":
            ids = torch.tensor([ctx.prefill_ids])

            @torch.no_grad()
            def run():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)

            describe = lambda tokens: "forward, logits of the last position"  # noqa: E731
        elif w.engine == "minimind compiled":
            # quick: only fp32 steps are compiled (12-20 s a graph for bf16 and int8, whose compiled steps
            # tests/test_decode_kernels.py checks); the others run the same decoder with eager steps
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


def time_in_rounds(prepared, repeats, log):
    """Each round runs every row once, in turn (after one untimed round): a host that speeds up or slows down
    during the run moves the rows of a round alike, so rows compare within a round (`PeersReport.ratios`)
    instead of across the minutes between them. Every other round runs backwards, so that no row always
    follows the same one (an engine's threads still spinning, its data in the cache)."""
    try:
        for p in prepared:
            p.run()
        for p in alternating_rounds(prepared, repeats):
            start = time.perf_counter()
            p.run()
            p.row.seconds.append(time.perf_counter() - start)
    finally:
        for p in prepared:
            p.close()
    for p in prepared:
        log(f"{p.row.workload.row_id}: {p.row.tokens_per_second:.1f} tok/s")


FP32_PRODUCTS = {
    "plain": "unpacked one-row products",
    "mkl": "MKL-packed weights",
    "onednn": "oneDNN-packed weights",
    "template": "inductor's C++ GEMM kernels",
}


def _compiled_decode(model, ids, new, weights, compile=True):
    """MiniMind's fast decode path (`minimind.decode.CompiledDecoder`, what `minimind-chat` uses): the greedy
    decode function, and the row's note from its tokens: the compile time and the tokens shared with plain
    `generate` at the same precision. `compile=False`: the same decoder with its steps run eagerly."""
    from minimind.decode import GROUPED_QUERY_SDPA, CompiledDecoder, fp32_product_kernel

    decoder = CompiledDecoder(model, compile=compile)

    @torch.no_grad()
    def decode():
        return decoder.generate(ids, max_new_tokens=new)[:, ids.shape[1] :].tolist()

    def describe(tokens):
        plain = _minimind_greedy(model, ids, new)
        shared = sum(leading_equal(a, b) for a, b in zip(tokens, plain))
        settings = decoder.inductor_settings(ids.shape[0])
        products = (
            FP32_PRODUCTS[fp32_product_kernel(ids.shape[0])] if decoder.dtype == torch.float32 else "prepacked weights"
        ) + (
            ", autotuned GEMMs"
            if settings["max_autotune"] and "ATEN" in settings["max_autotune_gemm_backends"]
            else ""
        )
        attention = (
            ", grouped-query attention over the written cache" if decoder.step_attention == GROUPED_QUERY_SDPA else ""
        )
        compiled = (
            f"torch.compile with freezing, merged projections, {products}{attention}, compiled in "
            f"{decoder.compile_seconds:.0f} s"
            if compile
            else f"steps run eagerly (quick mode){attention}"
        )
        return (
            f"CompiledDecoder: static cache, {compiled}; greedy tokens = plain {weights} generate: "
            f"{shared} / {sum(map(len, plain))}"
        )

    return decode, describe


def sft_batches(ctx, padded):
    """The first batches of the bundled SFT chats, in file order, either padded to max_seq_length (upstream
    MiniMind's way) or flattened into one padding-free row."""
    from minimind.data import build_dataset, collator

    max_len = 512
    batch, steps = ctx.sizes["sft_batch"], ctx.sizes["sft_steps"]
    dataset = build_dataset("sft", ctx.sft_data, ctx.tokenizer, max_len).select(range(batch * steps))
    if padded:
        from transformers import DataCollatorForSeq2Seq

        from minimind.data import IGNORE_INDEX

        collate = DataCollatorForSeq2Seq(
            ctx.tokenizer,
            padding="max_length",
            max_length=max_len,
            label_pad_token_id=IGNORE_INDEX,
            return_tensors="pt",
        )
    else:
        collate = collator("sft", ctx.tokenizer, padding_free=True)
    rows = [dataset[i] for i in range(len(dataset))]
    return [collate(rows[i : i + batch]) for i in range(0, len(rows), batch)]


def measure_sft(w, ctx):
    """A few AdamW steps from the same initial weights on the same examples; real tokens per second (pads not
    counted) and each step's loss, which padding-free packing must reproduce."""
    padded = w.weights.startswith("padded")
    batches = sft_batches(ctx, padded)
    model = MiniMindForCausalLM.from_pretrained(
        ctx.model_dir, dtype=torch.float32, attn_implementation=ctx.settings.attn_implementation
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = w.weights.endswith("-compiled")
    forward = torch.compile(model) if compiled else model  # what the Trainer's --torch_compile does
    row = PeerRow(
        w,
        shape=f"{ctx.sizes['sft_batch']} x 512"
        if padded
        else f"1 x {'/'.join(str(b['input_ids'].shape[1]) for b in batches)}",
    )
    real = []
    for batch in batches:
        inputs = {
            key: value
            for key, value in batch.items()
            if key in ("input_ids", "labels", "attention_mask", "position_ids")
        }
        start = time.perf_counter()
        loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        row.seconds.append(time.perf_counter() - start)
        row.losses.append(loss.item())
        real.append(int(batch["attention_mask"].sum()) if padded else batch["input_ids"].numel())
    row.tokens = sum(real)
    # The first step pays for allocation (activations, AdamW state) and, compiled, for compilation: throughput
    # counts the later steps.
    first = 1 if len(batches) > 1 else 0
    row_first_seconds = row.seconds[0]
    row.seconds, row.timed_tokens = row.seconds[first:], sum(real[first:])
    total = sum(b["input_ids"].numel() for b in batches)
    row.note = (
        f"{row.tokens:,} real tokens of {total:,} ({100 * row.tokens / total:.0f}%), "
        f"{len(batches)} steps, loss {' / '.join(f'{x:.4f}' for x in row.losses)}"
    )
    if compiled:
        row.note += f"; torch.compile, first step (compilation) {row_first_seconds:.0f} s"
    ctx.log(f"{w.row_id}: {row.tokens_per_second:.1f} real tok/s")
    return row


def serving_missing():
    for name in ("fastapi", "uvicorn", "httpx"):
        try:
            __import__(name)
        except ImportError as error:
            return f"{name} not installed ({error}); pip install -e .[serve]"
    return ""


def _stream_completion(http, prompt, max_tokens):
    """One streaming greedy completion through `http` (an httpx.Client on the server); the completion tokens the
    server's usage chunk reports."""
    import json

    body = {
        "model": "peers",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
    return usage["completion_tokens"]


def measure_serve(workloads, ctx):
    """The OpenAI-compatible server on loopback, one engine and weights: for each of `workloads` (rows of that
    server), N clients each streaming the same number of greedy completions one after another; total completion
    tokens per second of wall time. "minimind server" is the default engine (transformers' continuous batching),
    "minimind server compiled" is `--engine compiled`. The rows run in rounds on one server, as the decode rows
    do (`time_in_rounds`): a run lasts a few seconds, shorter than the host's own swings, so the 8-client row
    compares with the one-client row of its round."""
    from concurrent.futures import ThreadPoolExecutor

    new, per_client = ctx.sizes["serve_tokens"], ctx.sizes["serve_requests"]
    rows = [PeerRow(w, shape=f"{_clients(w)} x {per_client} requests (+{new})") for w in workloads]
    missing = serving_missing()
    if missing:
        for row in rows:
            row.skipped = missing
        return rows
    from minimind.serving import create_app, serve_in_thread

    engine = "compiled" if workloads[0].engine.endswith("compiled") else "paged"
    generator = ctx.server(workloads[0].weights, engine)

    import httpx

    with serve_in_thread(create_app(generator)) as url:
        # Each client keeps one client object and its connection, as the openai client does: building one per
        # request (its TLS context included) takes about 18 ms of the 2 cores the server runs on.
        https = [httpx.Client(base_url=url, timeout=600) for _ in range(max(map(_clients, workloads)))]

        def client(index):
            return sum(
                _stream_completion(https[index], f"{PEER_PROMPT} ({index}, {k})", new) for k in range(per_client)
            )

        def run(row):
            clients = _clients(row.workload)
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                tokens = sum(pool.map(client, range(clients)))
            seconds = time.perf_counter() - start
            # Greedy completions may end at eos: the row counts its first round's tokens, and a round that got
            # another number is timed at its own rate.
            row.tokens = row.tokens or tokens
            row.seconds.append(seconds * row.tokens / max(tokens, 1))

        _stream_completion(https[0], PEER_PROMPT, new)  # warm-up: the first step, the first pages
        for row in alternating_rounds(rows, ctx.repeats):
            run(row)
        for http in https:
            http.close()
    for row in rows:
        clients = _clients(row.workload)
        row.note = (
            f"{row.tokens} of {clients * per_client * new} tokens asked for, streaming, greedy, --engine {engine}"
        )
        ctx.log(f"{row.workload.row_id}: {row.tokens_per_second:.1f} tok/s")
    return rows


def _clients(workload):
    return int(workload.row_id.split("-")[2])


PEER_COLUMNS = [
    "row",
    "engine",
    "weights",
    "B x T (+new)",
    "tok/s",
    "weight bytes / token",
    "bandwidth floor tok/s (share)",
    "greedy tokens = MiniMind fp32",
    "notes",
]


@dataclass
class PeersReport:
    details: dict
    bandwidth: float  # bytes per second, the best large copy of this run
    rows: list
    settings: BenchmarkSettings

    def row(self, row_id):
        return next(r for r in self.rows if r.workload.row_id == row_id)

    def table(self):
        lines = ["| " + " | ".join(PEER_COLUMNS) + " |", "|" + "---|" * len(PEER_COLUMNS)]
        for row in self.rows:
            lines.append("| " + " | ".join(self._cells(row)) + " |")
        return "\n".join(lines)

    def _cells(self, row):
        w = row.workload
        if row.skipped:
            return [w.row_id, w.engine, w.weights, row.shape, "-", "-", "-", "-", "skipped: " + row.skipped]
        note = row.note
        if w.kind == "sft" and w.weights != "padded":
            padded = next(
                (r for r in self.rows if r.workload.row_id == "peers-sft-512-padded" and not r.skipped), None
            )
            if padded is not None:
                note += (
                    f"; loss max |diff| vs padded {sft_loss_difference(padded, row):.2e}, "
                    f"{row.tokens_per_second / padded.tokens_per_second:.2f}x padded's real tok/s"
                )
        if row.weight_bytes is None:
            bytes_cell = floor_cell = "-"
        else:
            floor = self.bandwidth / row.weight_bytes
            bytes_cell = f"{row.weight_bytes:,}"
            floor_cell = f"{floor:,.1f} ({100 * row.tokens_per_second / floor:.1f}%)"
        same = "-" if row.same_tokens is None else f"{row.same_tokens[0]} / {row.same_tokens[1]}"
        return [
            w.row_id,
            w.engine,
            w.weights,
            row.shape,
            f"{row.tokens_per_second:,.1f}",
            bytes_cell,
            floor_cell,
            same,
            note,
        ]

    def markdown(self):
        details = "\n".join(f"- {key}: {value}" for key, value in self.details.items())
        mode = "quick mode: tiny shapes, numbers meaningless" if self.settings.quick else "full mode"
        command = self.settings.command or "minimind-benchmark --table peers"
        return (
            f"## Peers\n\nGenerated by `{command}` ({mode}).\n\n{details}\n"
            f"- copy bandwidth measured in this run: {self.bandwidth / 1e9:.1f} GB/s\n\n"
            f"{self.table()}\n\n{self.ratios()}{PEER_NOTES}"
        )

    def ratios(self):
        """MiniMind's decode paths against llama.cpp at the matching precision (fp32 / f32, bf16 / f16 and bf16),
        and the server's 8 clients against its one, as bullet lines; only pairs measured in this run."""
        measured = {r.workload.row_id: r for r in self.rows if not r.skipped and r.tokens}
        lines = []
        for batch, ours in itertools.product(("", f"b{PEER_BATCH}-"), ("minimind", "minimind-compiled")):
            for weights, theirs in (("fp32", "f32"), ("bf16", "f16"), ("bf16", "bf16"), ("int8", "q8_0")):
                a, b = f"peers-decode-{batch}{ours}-{weights}", f"peers-decode-{batch}llamacpp-{theirs}"
                if a in measured and b in measured:
                    median, low, high = paired_ratio(measured[a], measured[b])
                    lines.append(f"- decode {a} / {b}: {median:.2f}x (rounds {low:.2f}-{high:.2f})")
        for suffix in ("", "-bf16", "-compiled"):  # batched serving: all clients' tokens/s against one client's
            a, b = f"peers-serve-8-clients{suffix}", f"peers-serve-1-clients{suffix}"
            if a in measured and b in measured:
                median, low, high = paired_ratio(measured[a], measured[b])
                lines.append(f"- serve {a} / {b}: {median:.2f}x (rounds {low:.2f}-{high:.2f})")
        return "\n".join(lines) + "\n\n" if lines else ""


PEER_NOTES = """\
- One random-init model (the 64M default config; quick: a tiny one) saved with the bundled tokenizer; llama.cpp
  (llama-cpp-python) reads the project's own GGUF export of it (minimind.export.export_gguf, one file per
  outtype). Batch 1; llama.cpp's n_threads = torch's threads.
- decode: greedy from a fixed prompt, eos ignored, the prompt's prefill included in the time; tok/s counts
  the generated tokens. minimind compiled = `minimind.decode.CompiledDecoder`, the chat command's default
  path; its compilation happens before the timed runs, and its note gives the tokens it shares with plain
  `generate` at the same precision. int8 = the decoder layers' weights in int8 (torchao, one scale per row),
  the tied LM head and the activations in bf16 (the chat command's `--int8`). b8 rows: 8 different prompts of the
  peer prompt's length decoded together (llama.cpp: one llama_decode over the 8 sequences each step).
  prefill-512: one forward over 512 tokens, tok/s counts them.
- rounds: the decode and prefill rows are built first, then timed in rounds, each running every row once in
  turn (one untimed round first, every other round backwards); tok/s is a row's median over the rounds. A ratio
  line is the median of the ratios within each round, their range in brackets: a host that speeds up or slows
  down during the run moves a round's rows alike.
- copy bandwidth: the best large torch tensor copy (bytes read + written per second) with the run's threads.
- weight bytes / token: the bytes of every matrix a decode step reads (decoder projections and the tied LM
  head) in that row's precision, q8_0 as 34 bytes per 32 values, int8 as a byte per value and a float32 scale
  per row (its LM head bf16); a b8 row reads them once per 8 tokens. Bandwidth floor: the copy bandwidth divided
  by those bytes, the fastest decode memory allows; the share is the row's tok/s against it.
- greedy tokens: how many leading generated tokens equal MiniMind fp32's, of all generated. Quantized paths
  may part ways early on a random-init model, whose logits lie close together.
- sft: AdamW steps from the same weights on the same examples in the same order, max_seq_length 512;
  padded = every sample padded to 512 (upstream MiniMind), packed = `--padding_free`. tok/s counts real
  (non-pad) tokens; the first step is left out of the timing. padded-compiled = padded with the model under
  `torch.compile`, as the Trainer's `--torch_compile` runs it (the first step compiles forward and backward).
- serve: the OpenAI-compatible server on loopback, fp32 or bf16 weights, torch's threads; each client streams
  its greedy completions one after another; tok/s = completion tokens of all clients / wall time, the median
  of the rounds, in which a server's 1- and 8-client rows take turns (ratios within each round). The default
  engine is transformers' continuous batching; compiled = `--engine compiled` (`CompiledDecoder`'s steps over a
  static cache with a position per row, compiled for batches 1, 2, 4 and 8 before the first row).
"""


def paired_ratio(ours, theirs):
    """The median and range of `ours`' tok/s over `theirs`' within each round (rows timed in the same rounds)."""
    ratios = sorted((ours.tokens / a) / (theirs.tokens / b) for a, b in zip(ours.seconds, theirs.seconds, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def sft_loss_difference(padded, packed):
    return max(abs(a - b) for a, b in zip(padded.losses, packed.losses))


def run_peers(settings, threads, log=print, on_row=None):
    import tempfile

    started = time.perf_counter()
    workloads = select_workloads(peer_workloads(), settings.rows)
    details = machine_details(torch.device("cpu"))
    try:
        import llama_cpp

        details["llama-cpp-python"] = llama_cpp.__version__
    except ImportError:
        details["llama-cpp-python"] = "not installed"
    details["cpu has amx_int8"] = amx_int8()
    bandwidth = copy_bandwidth(settings.quick)
    log(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    measured = {}

    def report_progress():
        if on_row and len(measured) < len(workloads):
            done = [measured[w.row_id] for w in workloads if w.row_id in measured]
            on_row(
                PeersReport(dict(details, partial=f"{len(done)} of {len(workloads)} rows"), bandwidth, done, settings)
            )

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
    if hasattr(os, "getloadavg"):
        details["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    details["run time"] = f"{time.perf_counter() - started:.0f} s"
    return PeersReport(details, bandwidth, rows, settings)


def splice_peers(old_text, peers_section):
    """The markdown file with its "## Peers" section (the end of the file) replaced, or added."""
    head = old_text.split("\n## Peers\n", 1)[0].rstrip("\n")
    return (head + "\n\n" if head else "") + peers_section


def peers_section_of(text):
    """The "## Peers" section a file already holds (kept when the main table is rewritten), or ""."""
    _, found, rest = text.partition("\n## Peers\n")
    return "## Peers\n" + rest if found else ""
