"""The benchmark end to end in --quick mode (tiny shapes, one repeat): table structure, the identical-weights
pairing and the KV-cache byte count. No timing is asserted: the machine is shared and noisy."""

import glob
import os
import re
import shlex

import pytest
import torch

from bench import run_benchmark
from bench.__main__ import main as bench_main
from bench.__main__ import parser as bench_parser
from bench.measure import describe_cpu_features, inductor_cache_of_caps
from bench.qwen3 import build_pair, matmul_params_per_token
from bench.report import MAIN_TITLE, TABLE_COLUMNS
from bench.workloads import BenchmarkSettings, default_workloads, model_shapes, select_workloads
from conftest import ROOT
from minimind.hardware import CAP_VARIABLES


def _table_rows(markdown):
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0], split[2:]  # header, body (the second line is the |---| rule)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("bench") / "results.md"
    bench_main(["--quick", "--device", "cpu", "--output", str(output)])
    return output.read_text()


def test_quick_run_writes_every_row(quick_run):
    """A quick run writes every row, with the machine's details."""
    header, body = _table_rows(quick_run)
    assert header == TABLE_COLUMNS
    assert [row[0] for row in body] == [w.row_id for w in default_workloads(quick=True, device_type="cpu")]
    # The machine once, at the top; then the table's section with what is particular to this run.
    assert quick_run.startswith("# Benchmark results\n")
    machine, main = quick_run.split("\n## Machine\n", 1)[1].split(f"\n## {MAIN_TITLE}\n", 1)
    for key in ("- cpu:", "- cores:", "- cpu features:", "- torch:", "- transformers:", "- python:"):
        assert machine.count(key) == 1 and key not in main
    for key in ("- date:", "- device: cpu", "- torch threads:", "- run time:", "matmul ceiling"):
        assert key in main
    for row in body:
        cells = dict(zip(header, row))
        if cells["verdict"] == "skipped":  # torch.compile is off on CPU unless asked for
            assert "compile" in cells["row"] and cells["notes"]
            continue
        assert float(cells["ours tok/s"].replace(",", "")) > 0
        assert float(cells["native tok/s"].replace(",", "")) > 0
        assert float(cells["ratio (min-max)"].split()[0]) > 0
        assert "%" in cells["ours GFLOP/s (% of ceiling)"] and "iB" in cells["peak mem ours / native"]


def test_kv_cache_bytes_match_the_formula(quick_run):
    """KV cache bytes equal the formula on every decode row."""
    header, body = _table_rows(quick_run)
    decode_rows = [dict(zip(header, row)) for row in body if row[0].startswith("decode") and row[7] != "skipped"]
    assert len(decode_rows) >= 6
    for cells in decode_rows:
        measured, sign, expected = cells["KV cache bytes (= formula)"].split()
        assert sign == "=" and measured == expected and int(measured.replace(",", "")) > 0
        assert cells["notes"].split(";")[0] in ("same tokens as native", "tokens differ from native (near-tie logits)")


@pytest.mark.parametrize("shape", ["64M", "moe-top2"])
def test_pair_gives_the_same_logits(shape):
    ours, native = build_pair(model_shapes(quick=True)[shape], torch.device("cpu"), torch.float32, "sdpa", seed=0)
    ids = torch.randint(3, ours.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)


def test_flop_count_covers_every_decoder_weight():
    ours, _ = build_pair(model_shapes(quick=True)["64M"], torch.device("cpu"), torch.float32, "sdpa", seed=0)
    layer_weights = sum(m.weight.numel() for m in ours.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params_per_token(ours.config) == layer_weights


def test_rows_filter_takes_globs_rejects_unknown():
    rows = default_workloads(quick=True, device_type="cpu")
    assert {w.row_id for w in select_workloads(rows, ["decode-static-*"])} == {
        "decode-static-b1-64M",
        "decode-static-b8-64M",
        "decode-static-compile-b1-64M",
    }
    with pytest.raises(ValueError, match="match no row"):
        select_workloads(rows, ["no-such-row"])


def test_profile_logs_op_tables_per_row():
    """--profile logs op tables, and a partial report follows each row."""
    logged, partial = [], []
    settings = BenchmarkSettings(
        device="cpu", quick=True, rows=["decode-dynamic-b1-64M", "prefill-*"], profile=["prefill-*"]
    )
    report = run_benchmark(settings, log=logged.append, on_row=partial.append)
    assert [w.workload.row_id for w in report.rows] == ["prefill-512-64M", "decode-dynamic-b1-64M"]
    # After the first of the two rows; the last row's report is the final one.
    assert [len(r.rows) for r in partial] == [1] and "- partial: 1 of 2 rows" in partial[0].markdown()
    profiles = [line for line in logged if line.startswith("profile of")]
    assert [p.split(":")[0] for p in profiles] == [
        "profile of prefill-512-64M, ours",
        "profile of prefill-512-64M, native",
    ]
    assert all("aten::mm" in p and "# of Calls" in p for p in profiles)


def test_cpu_features_name_vector_matrix_extensions():
    xeon = {"fma", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}
    assert describe_cpu_features(xeon) == "AVX2, AVX-512 (bf16, VNNI), AMX (bf16, int8)"
    assert describe_cpu_features({"fma", "avx2", "avx512f"}) == "AVX2, AVX-512"
    assert describe_cpu_features({"fp", "asimd", "sve"}) == "NEON, SVE"
    assert describe_cpu_features({"sse4_2"}) == "none of AVX2, AVX-512, AMX, NEON, SVE"
    assert describe_cpu_features(set()) == "not read (no /proc/cpuinfo)"


@pytest.fixture
def uncapped(monkeypatch, tmp_path):
    """No CPU cap and no inductor directory set; inductor's default directory under tmp_path. monkeypatch puts every
    variable back afterwards, the ones the code under test sets included."""
    for name in (*CAP_VARIABLES, "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    default = str(tmp_path / "torchinductor_user")
    monkeypatch.setattr("torch._inductor.runtime.cache_dir_utils.default_cache_dir", lambda: default)
    return default


def test_inductor_cache_is_apart_under_cpu_caps(uncapped, monkeypatch):
    assert inductor_cache_of_caps() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", uncapped)  # as importing inductor sets it
    apart = uncapped + "-ATEN_CPU_CAPABILITY_avx2-ONEDNN_MAX_CPU_ISA_AVX2"
    assert inductor_cache_of_caps() == apart and os.environ["TORCHINDUCTOR_CACHE_DIR"] == apart
    # inductor reads the variable at each use: what it compiles from here on lands in the caps' directory
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="inductor")
    x = torch.arange(8.0)
    torch.testing.assert_close(compiled(x), x.sin() + 1)
    assert glob.glob(os.path.join(apart, "**", "*.py"), recursive=True), os.listdir(apart)
    assert not os.path.exists(uncapped)
    # a directory chosen by hand stays
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/chosen")
    assert inductor_cache_of_caps() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/chosen"


def test_bench_sets_the_caps_directory_before_any_row(uncapped, monkeypatch, capsys):
    seen = []

    class Report:
        table = staticmethod(lambda: "")

    def run_benchmark(settings, log, on_row):
        seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return Report()

    monkeypatch.setattr("bench.__main__.run_benchmark", run_benchmark)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    bench_main(["--output", "-"])
    assert seen == [uncapped + "-MKL_ENABLE_INSTRUCTIONS_AVX2"]
    assert f"inductor's cache for these CPU caps: {seen[0]}" in capsys.readouterr().err


def test_documented_bench_commands_parse():
    """Every `python -m bench ...` that README.md or docs/ show parses with the command's flags
    (tests/docs/test_docs.py runs the `minimind-*` commands; a full benchmark takes minutes, so these are parsed
    only)."""
    shown = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(path, encoding="utf-8") as doc:
            text = doc.read().replace("\\\n", " ")
        shown += [shlex.split(rest) for rest in re.findall(r"python -m bench\b([^`\n|#]*)", text)]
    assert ["--table", "peers"] in shown  # the docs show both tables
    for argv in shown:
        bench_parser().parse_args(argv)
