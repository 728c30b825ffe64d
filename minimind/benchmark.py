"""MiniMind against transformers' own Qwen3 / Qwen3-MoE: same config, same weights, same process, same run.

The machine this runs on is usually shared, so absolute numbers drift from run to run. What counts is the
ratio: every repeat times ours and native back to back (alternating which goes first), and a row's ratio is
the median of those paired ratios. Each row also reports achieved GFLOP/s against a matmul ceiling measured
in the same run, peak memory, and for decode rows the KV cache's bytes, checked against
2 x layers x tokens x kv_heads x head_dim x dtype bytes.

Entry point: `run_benchmark(BenchmarkSettings(...))` -> `BenchmarkReport` (rows + markdown).
"""

import contextlib
import copy
import ctypes
import ctypes.util
import datetime
import fnmatch
import os
import platform
import statistics
import threading
import time
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
        tiny = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rope_theta=10000.0)
        moe = dict(tiny, use_moe=True, num_experts=4, moe_intermediate_size=96)
        return {"64M": tiny, "small": dict(tiny, hidden_size=32),
                "moe-top1": dict(moe, num_experts_per_tok=1), "moe-top2": dict(moe, num_experts_per_tok=2)}
    # MoE: the small shape with 4 experts the size of its dense MLP (active FLOPs at top-1 = the dense model).
    moe = dict(hidden_size=512, use_moe=True, num_experts=4)
    return {"64M": {}, "small": dict(hidden_size=512),
            "moe-top1": dict(moe, num_experts_per_tok=1), "moe-top2": dict(moe, num_experts_per_tok=2)}


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
            rows.append(Workload(f"decode-{cache}-b{batch}-64M", "64M", "decode", batch, prompt, new,
                                 dtype=decode_dtype, cache=cache))
    for shape in ("moe-top1", "moe-top2"):
        rows.append(Workload(f"train-fp32-{shape}", shape, "train", *train_bt, dtype="fp32"))
        rows.append(Workload(f"decode-dynamic-b1-{shape}", shape, "decode", 1, prompt, new, dtype=decode_dtype))
    # Last: its compile time is the one open-ended cost, and a run cut short keeps every row before it.
    rows.append(Workload("decode-static-compile-b1-64M", "64M", "decode", 1, prompt, new, dtype=decode_dtype,
                         cache="static", compile=True))
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
            mlp = (config.hidden_size * config.num_experts
                   + config.num_experts_per_tok * 3 * config.hidden_size * config.moe_intermediate_size)
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
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


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
    return 2 * size ** 3 / best / 1e9


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

    kwargs = dict(max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens, do_sample=False,
                  return_dict_in_generate=True, disable_compile=not compile_forward)
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


def race(fns, repeats, device):
    """Seconds per call for each model, interleaved (and the order alternated) so that both see the same
    machine load."""
    times = {name: [] for name in fns}
    for i in range(repeats):
        order = list(fns.items())
        for name, fn in (order if i % 2 == 0 else order[::-1]):
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
        return Row(w, [], [], 0, 0.0, skipped=(
            "torch.compile skipped on CPU (inductor compile time exceeds the run's budget; "
            "--compile on to try it)" if device.type == "cpu" else "--compile off"))
    weight_dtype = DTYPES[w.dtype] if w.kind != "train" else torch.float32
    ours, native = build_pair(shape_overrides, device, weight_dtype, settings.attn_implementation, settings.seed)
    config = ours.config
    generator = torch.Generator().manual_seed(settings.seed)
    ids = torch.randint(3, config.vocab_size, (w.batch, w.seq_len), generator=generator).to(device)

    if w.kind == "train":
        fns = {name: make_train_step(m, ids, device, w.dtype, config.use_moe)
               for name, m in (("ours", ours), ("native", native))}
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
    row = Row(w, times["ours"], times["native"], w.batch * (w.new_tokens if w.kind == "decode" else w.seq_len),
              workload_flops(config, w), peak_ours=peaks["ours"], peak_native=peaks["native"])
    if w.kind == "decode":
        out = outputs["ours"]
        assert out.sequences.shape[1] == w.seq_len + w.new_tokens
        cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.x renamed the field
        row.kv_bytes, row.kv_expected = kv_cache_bytes(cache), expected_kv_bytes(config, w)
        assert row.kv_bytes == row.kv_expected, (
            f"{w.row_id}: KV cache holds {row.kv_bytes} bytes, expected {row.kv_expected} "
            f"(2 x layers x tokens x kv_heads x head_dim x dtype bytes)")
    notes = []
    if w.kind == "decode":  # same length either way (min_new_tokens); same tokens says both computed alike
        same = torch.equal(outputs["ours"].sequences, outputs["native"].sequences)
        notes.append("same tokens as native" if same else "tokens differ from native (near-tie logits)")
    if config.use_moe:
        notes.append(f"native experts: {native.config._experts_implementation}")
    row.note = "; ".join(notes)
    log(f"{w.row_id}: ours {row.tokens_per_second(row.ours_seconds):.1f} tok/s, native "
        f"{row.tokens_per_second(row.native_seconds):.1f} tok/s, ratio {row.ratio:.3f}")
    return row


def _compile_enabled(settings, device):
    return settings.compile == "on" or (settings.compile == "auto" and device.type == "cuda")


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------

TABLE_COLUMNS = ["row", "shape", "B x T (+new)", "dtype", "ours tok/s", "native tok/s", "ratio (min-max)",
                 "verdict", "ours GFLOP/s (% of ceiling)", "peak mem ours / native", "KV cache bytes (= formula)",
                 "notes"]


@dataclass
class BenchmarkReport:
    details: dict
    ceilings: dict  # dtype name -> GFLOP/s
    rows: list
    settings: BenchmarkSettings

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
        return (f"# MiniMind vs transformers' Qwen3 / Qwen3-MoE\n\n"
                f"Generated by `{command}` ({mode}). Same config, same weights, same process; ours and "
                f"native interleaved on every repeat.\n\n"
                f"## Machine\n\n{details}\n- matmul ceiling measured in this run: {ceilings}\n\n"
                f"## Results\n\n{self.table()}\n\n## How to read it\n\n{REPORT_NOTES}")


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
    return f"{value / 2 ** 20:.0f} MiB" if value >= 2 ** 20 else f"{value / 2 ** 10:.0f} KiB"


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
    kv = "-" if row.kv_bytes is None else (
        f"{row.kv_bytes:,} {'=' if row.kv_bytes == row.kv_expected else '!='} {row.kv_expected:,}")
    ratios = row.ratios
    return [w.row_id, w.shape, shape, dtype, f"{row.tokens_per_second(row.ours_seconds):,.1f}",
            f"{row.tokens_per_second(row.native_seconds):,.1f}",
            f"{row.ratio:.3f} ({min(ratios):.2f}-{max(ratios):.2f})", row.verdict,
            f"{gflops:,.1f} ({100 * gflops / ceiling:.1f}%)", f"{_mib(row.peak_ours)} / {_mib(row.peak_native)}",
            kv, row.note]


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
    with intra_op_threads(threads):
        return _run(settings, device, log, on_row)


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
            on_row(BenchmarkReport(dict(details, partial=f"{len(rows)} of {len(workloads)} rows"), ceilings,
                                   list(rows), settings))
    # Measured again at the end and the better kept: a ceiling is the best the machine did in this run.
    ceilings = {name: max(value, matmul_ceiling(device, DTYPES[name], size)) for name, value in ceilings.items()}
    if hasattr(os, "getloadavg"):
        details["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    details["run time"] = f"{time.perf_counter() - started:.0f} s"
    return BenchmarkReport(details, ceilings, rows, settings)
