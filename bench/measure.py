"""How the benchmark measures: devices and threads, timing (paired repeats, rounds), peak memory, the matmul and
copy ceilings that rows are compared with, torch.profiler tables, and the machine a run is on."""

import contextlib
import ctypes
import ctypes.util
import datetime
import os
import platform
import statistics
import threading
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------------------
# Devices and threads
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


@contextlib.contextmanager
def intra_op_threads(count):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ----------------------------------------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------
# Ceilings: what the machine can do at best, measured in the same run
# ----------------------------------------------------------------------------------------------------------


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


# The checkout the benchmark runs from (bench/ is not installed).
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**settings) -> dict:
    """The environment of a process the benchmark starts, with `settings` added: this checkout's package first on
    PYTHONPATH, as the benchmark itself imports it (installed or not), a user's own entries after it."""
    paths = [CHECKOUT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **settings}


def inductor_cache_of_caps():
    """Under a cap, inductor's cache becomes a directory of its own for the caps set (TORCHINDUCTOR_CACHE_DIR, for
    this process and the servers it starts); returns it, or None where no cap is set or the directory was chosen by
    hand. Inductor's graph cache leaves the caps out of its key: under `ATEN_CPU_CAPABILITY=avx2` it loads the
    AVX-512 kernels an uncapped run compiled before, and the run would time the instructions it imitates away.
    Inductor reads the variable at each use, and sets it to its default when importing: that value is not a choice.
    Call it before anything compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from minimind.hardware import cpu_caps

    caps = [f"{name}_{value}" for name, value in cpu_caps().items()]
    if not caps or os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return None
    tag = "-".join("".join(c if c.isalnum() or c == "_" else "_" for c in cap) for cap in caps)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory = f"{default_cache_dir()}-{tag}"
    return directory


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


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


def time_in_rounds(prepared, repeats, log):
    """Each round runs every row once, in turn (after one untimed round): a host that speeds up or slows down
    during the run moves the rows of a round alike, so rows compare within a round (`paired_ratio`) instead of
    across the minutes between them. Every other round runs backwards, so that no row always follows the same
    one (an engine's threads still spinning, its data in the cache). `prepared`: objects with `row` (its
    `seconds` collect the times), `run` and `close`, which is called for every one once the rounds are over."""
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


def paired_ratio(ours, theirs):
    """The median and range of `ours`' tok/s over `theirs`' within each round (rows timed in the same rounds)."""
    ratios = sorted((ours.tokens / a) / (theirs.tokens / b) for a, b in zip(ours.seconds, theirs.seconds, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


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


# ----------------------------------------------------------------------------------------------------------
# The machine and the run
# ----------------------------------------------------------------------------------------------------------


def cpu_flags():
    """The CPU's feature flags (an empty set where they cannot be read)."""
    from minimind.hardware import cpu_features

    return set(cpu_features() or ())


def amx_int8():
    return "amx_int8" in cpu_flags()


def describe_cpu_features(flags):
    """The vector and matrix extensions the kernels choose between, in words."""
    if not flags:
        return "not read (no /proc/cpuinfo)"
    found = ["AVX2"] if "avx2" in flags else []
    if "avx512f" in flags:
        extensions = [name for flag, name in (("avx512_bf16", "bf16"), ("avx512_vnni", "VNNI")) if flag in flags]
        found.append("AVX-512" + (f" ({', '.join(extensions)})" if extensions else ""))
    amx = [name for flag, name in (("amx_bf16", "bf16"), ("amx_int8", "int8")) if flag in flags]
    if amx:
        found.append(f"AMX ({', '.join(amx)})")
    found += [name for flag, name in (("asimd", "NEON"), ("sve", "SVE")) if flag in flags]  # Arm
    return ", ".join(found) or "none of AVX2, AVX-512, AMX, NEON, SVE"


def machine_details():
    """The machine and software a run is on, the same for every table it writes: the results file names it once."""
    cpu = platform.processor() or platform.machine()
    import transformers

    from minimind.hardware import cpuinfo

    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    details = {
        "cpu": cpuinfo().get("model name") or cpu,
        "cores": os.cpu_count(),
        "cpu features": describe_cpu_features(cpu_flags()),
    }
    if torch.cuda.is_available():
        details["gpu"] = torch.cuda.get_device_name()
    details["torch"] = torch.__version__ + (f" (CPU kernels: {capability})" if capability else "")
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        details["oneDNN ISA cap"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    # MKL and fbgemm pick their kernels by themselves, whatever torch's capability says
    for variable, label in (("MKL_ENABLE_INSTRUCTIONS", "MKL"), ("FBGEMM_ENABLE_INSTRUCTIONS", "fbgemm")):
        if os.environ.get(variable):
            details[f"{label} instructions cap"] = os.environ[variable]
    details["transformers"] = transformers.__version__
    details["python"] = platform.python_version()
    return details


def run_details(device):
    """What is particular to one run: when, on which device, with how many threads, under what load."""
    details = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch threads": torch.get_num_threads(),
    }
    from minimind.heap import USER_SETTINGS, heap_kept

    user_settings = [f"{name}={os.environ[name]}" for name in USER_SETTINGS if name in os.environ]
    if heap_kept():
        details["heap"] = "freed memory kept for reuse, as the inference commands keep it (minimind.heap.keep_heap)"
    elif user_settings:
        details["heap"] = "glibc's thresholds as set: " + " ".join(user_settings)
    else:
        details["heap"] = "the C library's defaults"
    if hasattr(os, "getloadavg"):
        details["load average at start (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return details


def finish_details(details, started):
    """The run details at the end of a run: the load average then and the run's wall time."""
    if hasattr(os, "getloadavg"):
        details["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    details["run time"] = f"{time.perf_counter() - started:.0f} s"
    return details
