"""The measurement lab: MiniMind timed against transformers' own Qwen3 / Qwen3-MoE on the same weights (the main
table) and against its peers on the same 64M model (llama.cpp on our GGUF export, compiled decoding, padded and
padding-free SFT, the server). It lives in the repository, not in the installed package: run it from the repo
root with `python -m bench [flags]` (`make bench`); it writes docs/results.md.

Entry point: `run_benchmark(BenchmarkSettings(...))` -> `BenchmarkReport` (rows + markdown), or `PeersReport`
with `table="peers"`. Modules: workloads (settings, rows, selection), measure (timing, memory, ceilings,
machine), qwen3 (the main table), peers with llama_cpp, sft and serve (the peers table), data (the data table:
preparing 10-500 MB corpora), report (tables and the results file), __main__ (the command line).
"""

import torch

from bench.measure import intra_op_threads, resolve_device
from bench.workloads import TABLES, BenchmarkSettings, default_workloads, peer_workloads, row_matches

__all__ = ["TABLES", "BenchmarkSettings", "run_benchmark"]


def run_benchmark(settings, log=print, on_row=None):
    """Measure every selected row; `on_row(report)` sees the report so far after each row (a run that is cut
    short can still leave its table behind)."""
    # Imported here, not with the package: the data table's measured processes (`python -m bench.data`) would
    # otherwise time and weigh the other tables' imports (Qwen3, llama.cpp, the server) along with the command's.
    from bench.peers import run_peers
    from bench.qwen3 import run_main

    device = resolve_device(settings.device)
    # Quick mode's tiny ops gain nothing from a second CPU thread, and on a shared machine every multi-threaded
    # op can stall on a descheduled worker: one thread keeps the smoke test fast.
    threads = 1 if settings.quick and device.type == "cpu" else torch.get_num_threads()
    if settings.table not in TABLES:
        raise ValueError(f"table must be one of {TABLES}, got {settings.table!r}")
    with intra_op_threads(threads):
        if settings.table == "main":
            return run_main(settings, device, log, on_row)
        if settings.table == "peers":
            return run_peers(settings, threads, log, on_row)
        if settings.table == "data":
            from bench.data import run_data

            return run_data(settings, log, on_row)
        # Both tables: --rows may name rows of either, so only a pattern matching neither is an error.
        main_rows = [w.row_id for w in default_workloads(settings.quick, device.type)]
        peer_rows = [w.row_id for w in peer_workloads()]
        if settings.rows and not any(row_matches(r, settings.rows) for r in main_rows + peer_rows):
            raise ValueError(f"--rows {settings.rows} match no row. Rows: {', '.join(main_rows + peer_rows)}")
        report = None
        if not settings.rows or any(row_matches(r, settings.rows) for r in main_rows):
            report = run_main(settings, device, log, on_row)
        if not settings.rows or any(row_matches(r, settings.rows) for r in peer_rows):
            peers = run_peers(settings, threads, log)
            if report is None:
                return peers
            report.peers = peers
        return report
