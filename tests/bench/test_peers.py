"""The peers table (`python -m bench --table peers`) in --quick mode: llama.cpp on the project's GGUF export,
MiniMind's generate, padded vs padding-free SFT. Checked with counts and byte totals, never timings."""

import os
import re

import pytest
import torch

from bench import run_benchmark
from bench.__main__ import main as bench_main
from bench.llama_cpp import gguf_matrix_bytes, llama_cpp_missing
from bench.measure import amx_int8, machine_details, paired_ratio, time_in_rounds
from bench.peers import (
    FP32_PRODUCTS,
    TIED_HEAD_SUMS,
    PeerContext,
    PreparedPeer,
    decode_matrices,
    int8_missing,
    weight_bytes_per_token,
)
from bench.qwen3 import matmul_params_per_token
from bench.report import MAIN_TITLE, PEER_COLUMNS, PeersReport, document, merge_results
from bench.serve import serving_missing
from bench.workloads import (
    PEER_BATCH,
    PEER_OUTTYPES,
    PEER_PROMPT,
    BenchmarkSettings,
    PeerRow,
    PeerWorkload,
    peer_workloads,
    select_workloads,
)
from conftest import ROOT, TOKENIZER_DIR, tiny_model
from minimind.data import build_dataset
from minimind.decode import INTEL_CPU, fp32_product_kernel, onednn_products

MAIN_SECTION = f"## {MAIN_TITLE}\n\n| row |\n|---|\n| kept |\n"
HAND_SECTION = "## Notes\n\nwritten by hand\n"


def _table(markdown):
    lines = [line for line in markdown.split("## Peers", 1)[1].splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return split[0], [dict(zip(split[0], row)) for row in split[2:]]


@pytest.fixture(scope="module")
def peers_run(tmp_path_factory):
    """The command as a user runs it, into a file that already holds the main table (measured on this machine)
    and a section written by hand."""
    output = tmp_path_factory.mktemp("peers") / "results.md"
    output.write_text(document(machine_details(), MAIN_SECTION, HAND_SECTION) + "\n")
    report = bench_main(["--quick", "--device", "cpu", "--table", "peers", "--output", str(output)])
    return report, output.read_text()


def test_table_has_peer_rows_in_order(peers_run):
    """The table has every peer row in order and keeps the main table."""
    report, text = peers_run
    assert isinstance(report, PeersReport)
    # The machine named once at the top, the main table untouched before the peers, the hand-written notes last.
    assert text.startswith("# Benchmark results\n") and text.count("\n## Machine\n") == text.count("- cores:") == 1
    assert "\n" + MAIN_SECTION + "\n## Peers\n" in text and text.endswith("\n" + HAND_SECTION)
    header, rows = _table(text)
    assert header == PEER_COLUMNS
    assert [r["row"] for r in rows] == [w.row_id for w in peer_workloads()]
    assert "copy bandwidth measured in this run" in text and "- llama-cpp-python:" in text
    for r in rows:
        if r["engine"] == "minimind":  # needs nothing beyond the project's own requirements
            assert not r["notes"].startswith("skipped")
        if not r["notes"].startswith("skipped"):
            assert float(r["tok/s"].replace(",", "")) > 0


def test_llama_cpp_rows_run_or_say_why_not(peers_run):
    _, text = peers_run
    _, rows = _table(text)
    missing = llama_cpp_missing()
    for r in rows:
        if r["engine"] != "llama.cpp":
            continue
        if missing:
            assert r["notes"] == "skipped: " + missing
        elif r["weights"] == "q8_0" and amx_int8():  # runs on llama.cpp's plain CPU kernels
            assert r["notes"] == (
                "n_threads 1; extra buffer types off (AMX-INT8 q8_0 kernels segfault: ggml-org/llama.cpp#20824)"
            )
            assert float(r["tok/s"].replace(",", "")) > 0
        else:
            assert r["notes"] == "n_threads 1" and float(r["tok/s"].replace(",", "")) > 0


def test_greedy_counts_reported_f32_matches_fp32(peers_run):
    """Greedy token counts are reported, and f32 matches MiniMind fp32."""
    report, text = peers_run
    _, rows = _table(text)
    decode = {r["row"]: r for r in rows if "-decode-" in r["row"] and not r["notes"].startswith("skipped")}
    for r in decode.values():
        batch = PEER_BATCH if "-decode-b8-" in r["row"] else 1
        equal, compared = (int(x) for x in r["greedy tokens = MiniMind fp32"].split(" / "))
        assert compared == 8 * batch and 0 <= equal <= compared
        assert r["B x T (+new)"].startswith(f"{batch} x ") and r["B x T (+new)"].endswith("(+8)")
    assert decode["peers-decode-minimind-fp32"]["greedy tokens = MiniMind fp32"] == "8 / 8"
    # The batched rows decode PEER_BATCH distinct prompts: fp32 generate and the compiled fp32 path agree on all.
    assert decode["peers-decode-b8-minimind-fp32"]["greedy tokens = MiniMind fp32"] == "64 / 64"
    assert decode["peers-decode-b8-minimind-compiled-fp32"]["greedy tokens = MiniMind fp32"] == "64 / 64"
    batched = report.row("peers-decode-b8-minimind-compiled-fp32").note
    assert (
        "with freezing, merged projections, oneDNN-packed weights, grouped-query attention over the written "
        "cache, compiled in" in batched
    )
    assert batched.endswith("greedy tokens = plain fp32 generate: 64 / 64")
    # The compiled fp32 path gives generate's tokens; each compiled row says how many it shares with plain
    # generate at its own precision and how long compilation took.
    assert decode["peers-decode-minimind-compiled-fp32"]["greedy tokens = MiniMind fp32"] == "8 / 8"
    assert decode["peers-decode-minimind-compiled-fp32"]["notes"].endswith(
        "greedy tokens = plain fp32 generate: 8 / 8"
    )
    kernel = fp32_product_kernel(1)  # this CPU maker's kernel, the tied head as sums beside the template
    one_row = FP32_PRODUCTS[kernel] + (TIED_HEAD_SUMS if kernel == "template" else "")
    assert (
        f"torch.compile with freezing, merged projections, {one_row}, grouped-query attention "
        "over the written cache, compiled in" in report.row("peers-decode-minimind-compiled-fp32").note
    )
    # The compiled prefill rows run the decoder's prompt path: fp32 through oneDNN where MKL runs slow.
    onednn = not INTEL_CPU and torch.backends.mkldnn.is_available()
    products = "fp32 products through oneDNN" if onednn else "the model's own products"
    assert report.row("peers-prefill-512-minimind-compiled-fp32").note == (
        f"CompiledDecoder's prompt: forward with {products}, logits of the last position"
    )
    # Quick mode compiles fp32 steps only: the 16-bit and int8 rows run the same decoder's steps eagerly, at both
    # batch sizes, each checked against generate at its own precision.
    for weights in ("bf16", "int8"):
        for batch in ("", f"b{PEER_BATCH}-"):
            row = report.row(f"peers-decode-{batch}minimind-compiled-{weights}")
            if weights == "int8" and int8_missing():
                assert row.skipped == int8_missing()
                continue
            assert row.note.startswith(
                "CompiledDecoder: static cache, steps run eagerly (quick mode), grouped-query "
                f"attention over the written cache; greedy tokens = plain {weights} generate: "
            )
            assert row.note.endswith(f" / {8 * (PEER_BATCH if batch else 1)}")
    if not llama_cpp_missing():

        def ratio_line(ours, theirs, kind="decode"):
            a, b = report.row(ours), report.row(theirs)
            (ours_seconds,), (theirs_seconds,) = a.seconds, b.seconds  # quick mode: one round
            ratio = (a.tokens / ours_seconds) / (b.tokens / theirs_seconds)
            return f"- {kind} {ours} / {theirs}: {ratio:.2f}x (rounds {ratio:.2f}-{ratio:.2f})\n"

        for ours in ("minimind", "minimind-compiled"):
            for weights, theirs in (("fp32", "f32"), ("bf16", "f16")):
                line = ratio_line(
                    f"peers-prefill-512-{ours}-{weights}", f"peers-prefill-512-llamacpp-{theirs}", "prefill"
                )
                assert line in text

        if not int8_missing():
            assert ratio_line("peers-decode-minimind-compiled-int8", "peers-decode-llamacpp-q8_0") in text
        assert ratio_line("peers-decode-minimind-compiled-fp32", "peers-decode-llamacpp-f32") in text
        # Same weights in the same precision: llama.cpp's float32 graph picks the same greedy tokens, one
        # sequence or a batch of them.
        assert decode["peers-decode-llamacpp-f32"]["greedy tokens = MiniMind fp32"] == "8 / 8"
        assert report.row("peers-decode-llamacpp-f32").same_tokens == (8, 8)
        assert report.row("peers-decode-b8-llamacpp-f32").same_tokens == (64, 64)
        assert ratio_line("peers-decode-b8-minimind-compiled-fp32", "peers-decode-b8-llamacpp-f32") in text
        assert ratio_line("peers-decode-b8-minimind-compiled-bf16", "peers-decode-b8-llamacpp-f16") in text


@pytest.mark.parametrize(
    "weights",
    [
        "fp32",
        "bf16",
        "bf16 without AMX",
        "bf16 under AVX2",
        "int8",
        "int8 without dot products",
        "int8 over float32 activations",
    ],
)
def test_compiled_rows_describe_their_kernels(weights, monkeypatch):
    """The note of a full run's compiled decode row, read off the decoder's own settings (nothing is compiled
    until the row runs)."""
    from bench.peers import _compiled_decode, _minimind_greedy
    from minimind.decode import compiled, fbgemm, int8, quantize_weights_int8

    if weights.startswith("int8") and int8_missing():
        pytest.skip(int8_missing())
    if weights in ("int8 without dot products", "int8 over float32 activations", "bf16 under AVX2") and not (
        fbgemm.fbgemm_products()
    ):
        pytest.skip("this torch has no fbgemm (x86 builds only)")
    # a CPU without bfloat16 arithmetic or 8-bit dot products, where int8 weights take float32 activations
    sums = weights == "int8 over float32 activations"
    if weights in ("int8 without dot products", "int8 over float32 activations"):
        weights = "int8"
        monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: False)
    else:
        monkeypatch.setattr(int8, "cpu_computes_natively", lambda dtype: True)
    # where torch's kernels stop at AVX2 (only the rows' choice is imitated: the steps' other settings stay native)
    avx2 = weights == "bf16 under AVX2"
    # bfloat16 arithmetic with AMX's tiles, or without them (one row then takes the template alone)
    tiles = weights != "bf16 without AMX"
    features = {"avx512_bf16", "avx512_vnni"} | ({"amx_bf16"} if tiles else set())
    monkeypatch.setattr(compiled, "usable_cpu_features", lambda: frozenset(features))
    weights = weights.removesuffix(" under AVX2").removesuffix(" without AMX")
    monkeypatch.setattr(fbgemm, "torch_kernels_avx512", lambda: not avx2)
    monkeypatch.setattr(compiled, "onednn_products", lambda model: onednn_products(model, intel=False))
    seven_bit = int8.cpu_computes_natively(torch.int8) is False
    model = tiny_model(std=0.3)
    if weights != "fp32" and not sums:
        model = model.to(torch.bfloat16)
    if weights == "int8":
        quantize_weights_int8(model)
    ids = torch.tensor([[5, 17, 3, 42]])
    for rows in (ids, ids.repeat(PEER_BATCH, 1)):
        _, describe = _compiled_decode(model, rows, 4, weights)
        plain = _minimind_greedy(model, rows, 4)
        frozen = "with freezing, merged projections"
        if sums and rows.shape[0] == 1:
            products, frozen = "int8 values widened in float32 sums, four to a word", "without freezing"
        elif weights == "fp32":
            kernel = fp32_product_kernel(rows.shape[0])
            products = FP32_PRODUCTS[kernel] + (TIED_HEAD_SUMS if kernel == "template" else "")
        elif avx2 and rows.shape[0] > 1:
            products = "16-bit weights as float16 through fbgemm"
        elif not tiles and rows.shape[0] == 1:
            products = FP32_PRODUCTS["template"] + TIED_HEAD_SUMS
        elif weights == "bf16" or rows.shape[0] == 1:
            products = "prepacked weights, autotuned GEMMs"
        elif seven_bit:
            products = "7-bit activations per row through fbgemm"
        else:
            products = "prepacked weights, 8-bit activations per row, autotuned GEMMs"
        # a prompt multiplies through fbgemm where steps of several rows do, fp32 through oneDNN (not on Intel)
        prompt = "; the prompt's products through fbgemm" if avx2 or (weights == "int8" and seven_bit) else ""
        onednn = weights == "fp32" and torch.backends.mkldnn.is_available()
        prompt = "; the prompt's fp32 products through oneDNN" if onednn else prompt
        assert describe(plain) == (
            f"CompiledDecoder: static cache, torch.compile {frozen}, "
            f"{products}, grouped-query attention over the written cache, compiled in 0 s{prompt}; "
            f"greedy tokens = plain {weights} generate: {4 * rows.shape[0]} / {4 * rows.shape[0]}"
        )


def test_padded_and_packed_sft_losses_match(peers_run):
    """Padded and packed SFT train on the same real tokens with the same losses."""
    report, _ = peers_run
    padded, packed = report.row("peers-sft-512-padded"), report.row("peers-sft-512-packed")
    assert len(padded.losses) == len(packed.losses) == 2
    assert max(abs(a - b) for a, b in zip(padded.losses, packed.losses)) < 1e-5
    # The first 2 x 2 chats of the bundled file, counted independently of the collators.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    dataset = build_dataset("sft", os.path.join(ROOT, "data", "sft.jsonl"), tokenizer, 512).select(range(4))
    real = sum(len(ids) for ids in dataset["input_ids"])
    assert padded.tokens == packed.tokens == real
    assert f"{real:,} real tokens of {4 * 512:,}" in padded.note
    assert f"{real:,} real tokens of {real:,} (100%)" in packed.note
    # Compiled training (the Trainer's --torch_compile) on the same padded batches: the same losses to float
    # rounding, its compile step named and left out of the timing.
    compiled = report.row("peers-sft-512-padded-compiled")
    assert compiled.tokens == real and len(compiled.seconds) == 1
    assert max(abs(a - b) for a, b in zip(padded.losses, compiled.losses)) < 1e-4
    assert "torch.compile, first step (compilation)" in compiled.note


def test_bandwidth_floor_uses_exact_weight_bytes(peers_run, tmp_path):
    report, text = peers_run
    ctx = PeerContext(BenchmarkSettings(quick=True), str(tmp_path), threads=1, log=lambda line: None)
    config = ctx.config
    params = matmul_params_per_token(config) + config.vocab_size * config.hidden_size  # layers + tied LM head
    rows = sum(rows for rows, _ in decode_matrices(config))  # the layers' and the LM head's
    expected = {
        "fp32": 4 * params,
        "bf16": 2 * params,
        "f32": 4 * params,
        "f16": 2 * params,
        "q8_0": params // 32 * 34,
        "int8": params + 4 * rows,
    }
    assert params % 32 == 0  # every tiny-model row length is a multiple of 32, so all of q8_0 is blocks
    for weights, count in expected.items():
        assert weight_bytes_per_token(config, weights) == count
    for weights in ("fp32", "bf16"):  # the loaded model's own tensors
        model = ctx.minimind(weights)
        linear = sum(
            m.weight.numel() * m.weight.element_size()
            for m in model.model.layers.modules()
            if isinstance(m, torch.nn.Linear)
        )
        embed = model.model.embed_tokens.weight
        assert model.config.tie_word_embeddings
        assert linear + embed.numel() * embed.element_size() == expected[weights]
    if not int8_missing():  # torchao's int8 tensors: a byte per weight and a float32 scale per row
        model = ctx.minimind("int8")
        read = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the layers and the LM head
        stored = sum(w.qdata.numel() * w.qdata.element_size() + w.scale.numel() * w.scale.element_size() for w in read)
        assert stored == expected["int8"]
    for outtype in PEER_OUTTYPES:  # the bytes llama.cpp reads are the file's own matrices
        assert gguf_matrix_bytes(ctx.gguf(outtype)) == expected[outtype]
    _, rows = _table(text)
    for r in rows:
        if "-decode-" in r["row"] and not r["notes"].startswith("skipped"):
            per_token = expected[r["weights"]] // (
                PEER_BATCH if "-decode-b8-" in r["row"] else 1
            )  # weights read once a step
            assert int(r["weight bytes / token"].replace(",", "")) == per_token
            floor = report.bandwidth / per_token
            assert r["bandwidth floor tok/s (share)"].startswith(f"{floor:,.1f} (")


def test_rows_select_peers_in_one_namespace():
    """--rows selects peer rows; both tables share one namespace of row names."""
    assert [w.row_id for w in select_workloads(peer_workloads(), ["peers-*-llamacpp-q8_0"])] == [
        "peers-decode-llamacpp-q8_0",
        "peers-decode-b8-llamacpp-q8_0",
        "peers-prefill-512-llamacpp-q8_0",
    ]
    # --table all with patterns naming peer rows only: just those run, and the result is the peers table.
    report = run_benchmark(
        BenchmarkSettings(device="cpu", quick=True, table="all", rows=["peers-prefill-*-minimind-*"]),
        log=lambda line: None,
    )
    assert [r.workload.row_id for r in report.rows] == [
        "peers-prefill-512-minimind-fp32",
        "peers-prefill-512-minimind-bf16",
        "peers-prefill-512-minimind-compiled-fp32",
        "peers-prefill-512-minimind-compiled-bf16",
        "peers-prefill-512-minimind-compiled-int8",
    ]
    with pytest.raises(ValueError, match="match no row"):
        run_benchmark(BenchmarkSettings(device="cpu", quick=True, table="all", rows=["no-such-row"]))


def test_run_rewrites_only_its_own_section():
    machine, peers = {"cpu": "X", "cores": 2}, "## Peers\n\n| row |\n|---|\n| peers-x |\n"
    newer = peers.replace("peers-x", "peers-y")
    old = document(machine, MAIN_SECTION, peers, HAND_SECTION) + "\n"
    # A peers run: its section replaced; the main table and the hand-written notes kept, in their places.
    assert merge_results(old, document(machine, newer)) == (
        document(machine, MAIN_SECTION, newer, HAND_SECTION) + "\n",
        [],
    )
    # A main run into a file holding only the peers table: the main table goes first. A new file: the run's own.
    assert merge_results(document(machine, peers), document(machine, MAIN_SECTION))[0] == (
        document(machine, MAIN_SECTION, peers) + "\n"
    )
    assert merge_results("", document(machine, peers)) == (document(machine, peers) + "\n", [])
    # Measured on another machine: the file names one, so the other table goes; the notes stay.
    other = {"cpu": "Y", "cores": 2}
    assert merge_results(old, document(other, newer)) == (document(other, newer, HAND_SECTION) + "\n", [MAIN_TITLE])


def test_main_run_leaves_the_peers_section(tmp_path, monkeypatch):
    """The main run rewrites its part and leaves the peers' section."""
    import bench.__main__

    machine, new_main = machine_details(), f"## {MAIN_TITLE}\n\nnew main table\n"

    class Main:  # stands in for a measured main table
        settings = BenchmarkSettings()

        def markdown(self):
            return document(machine, new_main)

        def table(self):
            return "| new |"

    output = tmp_path / "results.md"
    section = "## Peers\n\n| row |\n|---|\n| peers-x |\n"
    output.write_text(document(machine, MAIN_SECTION, section, HAND_SECTION) + "\n")
    monkeypatch.setattr(bench.__main__, "run_benchmark", lambda settings, **kwargs: Main())
    bench_main(["--output", str(output)])
    assert output.read_text() == document(machine, new_main, section, HAND_SECTION) + "\n"


def test_serve_rows_count_reported_tokens(peers_run):
    report, text = peers_run
    for suffix, weights in (("", "fp32"), ("-bf16", "bf16"), ("-compiled", "fp32"), ("-compiled-bf16", "bf16")):
        for clients in (1, 8):
            row = report.row(f"peers-serve-{clients}-clients{suffix}")
            assert row.workload.weights == weights
            assert row.workload.engine == "minimind server" + (" compiled" if "compiled" in suffix else "")
            if serving_missing():
                assert row.skipped == serving_missing()
                continue
            asked = clients * 1 * 8  # quick: one request of 8 tokens per client
            assert 0 < row.tokens <= asked and row.note.startswith(f"{row.tokens} of {asked} tokens asked for")
            engine = "compiled" if "compiled" in suffix else "paged"
            # the percentiles of the requests' latencies: to the first token (ms) and to the end (s)
            assert re.search(
                rf"--engine {engine}; per request over {clients}, p50 / p90 / p99: first token \d+ / \d+ / \d+ ms, "
                r"whole \d+\.\d\d / \d+\.\d\d / \d+\.\d\d s; text in \d+ chunks a request \(p50\)$",
                row.note,
            ), row.note
        if not serving_missing():
            many, one = (report.row(f"peers-serve-{n}-clients{suffix}") for n in (8, 1))
            assert len(many.seconds) == len(one.seconds) == 1  # quick: one round
            ratio = many.tokens_per_second / one.tokens_per_second
            assert (
                f"- serve peers-serve-8-clients{suffix} / peers-serve-1-clients{suffix}: {ratio:.2f}x "
                f"(rounds {ratio:.2f}-{ratio:.2f})" in text
            )


@pytest.mark.skipif(bool(serving_missing()), reason=serving_missing() or "")
def test_serve_rows_take_turns_on_one_server(monkeypatch):
    """Serve rows take turns on one server, stopped after them, and a short round keeps its rate."""
    import contextlib
    import types

    import bench.serve

    started, completions, stopped = [], [], []

    @contextlib.contextmanager
    def server(ctx, weights, engine):
        started.append((weights, engine))
        yield "http://127.0.0.1:1", 5.0
        stopped.append(len(completions))

    monkeypatch.setattr(bench.serve, "server_process", server)

    def completion(http, prompt, max_tokens, latencies=None):
        completions.append(prompt)
        if latencies is not None:  # the warm-up passes none
            # first token after 25, 50, 75 or 100 ms; text in 1, 2, 3 or 4 chunks
            latencies.append((0.025 * (len(completions) % 4 + 1), 2.0, len(completions) % 4 + 1))
        short_round = len(completions) == 1 + 2 + 16 + 1  # the second round's first completion (8 clients)
        return 1 if short_round else max_tokens

    clock = iter(range(1000))  # each reading one second after the last
    monkeypatch.setattr(bench.serve, "_stream_completion", completion)
    monkeypatch.setattr(bench.serve.time, "perf_counter", lambda: float(next(clock)))
    ctx = types.SimpleNamespace(repeats=3, sizes=dict(new_tokens=4, serve_requests=2), log=lambda line: None)
    workloads = [
        w for w in peer_workloads() if w.row_id in ("peers-serve-1-clients-bf16", "peers-serve-8-clients-bf16")
    ]
    one, eight = bench.serve.measure_serve(workloads, ctx)
    assert started == [("bf16", "paged")]  # one server for both rows
    assert stopped == [len(completions)] == [1 + 3 * (2 + 16)]  # stopped after every completion
    # after one warm-up completion, three rounds: 1 then 8 clients, 8 then 1, 1 then 8; each client asks twice
    assert completions[0] == PEER_PROMPT
    sizes = [2, 16, 16, 2, 2, 16]
    runs = [completions[1 + sum(sizes[:i]) : 1 + sum(sizes[: i + 1])] for i in range(len(sizes))]
    assert [sorted({prompt.rsplit(" (", 1)[1] for prompt in run}) for run in runs[:2]] == [
        ["0, 0)", "0, 1)"],
        [f"{i}, {k})" for i in range(8) for k in range(2)],
    ]
    assert [len({prompt.rsplit(" (", 1)[1].split(",")[0] for prompt in run}) for run in runs] == [1, 8, 8, 1, 1, 8]
    assert one.tokens == 2 * 4 and eight.tokens == 8 * 2 * 4 and one.seconds == [1.0, 1.0, 1.0]
    # The 8-client round that got 61 tokens of 64 is timed at its rate: 64 tokens in 64 / 61 s.
    assert eight.seconds == [1.0, 64 / 61, 1.0]
    assert eight.note == (
        "64 of 64 tokens asked for, streaming, greedy, --engine paged; per request over 48, p50 / p90 / p99: "
        "first token 50 / 100 / 100 ms, whole 2.00 / 2.00 / 2.00 s; text in 2 chunks a request (p50)"
    )
    assert bench.serve.percentiles(range(100, 0, -1)) == [50, 90, 99]
    assert bench.serve.percentiles([0.3, 0.1, 0.2]) == [0.2, 0.3, 0.3]
    assert paired_ratio(eight, one) == (8.0, 61 / 8, 8.0)


def test_rows_are_timed_and_compared_in_rounds():
    calls, closed = [], []

    def prepared(name, fail_at=None):
        row = PeerRow(PeerWorkload(f"peers-decode-{name}", "decode", name, "fp32"), tokens=100)

        def run():
            calls.append(name)
            if len(calls) == fail_at:
                raise RuntimeError("engine failed")

        return PreparedPeer(row, run, close=lambda: closed.append(name))

    rows = [prepared("a"), prepared("b"), prepared("c")]
    time_in_rounds(rows, repeats=3, log=lambda line: None)
    # one untimed round, then three timed ones, the middle one backwards
    assert calls == ["a", "b", "c"] * 2 + ["c", "b", "a"] + ["a", "b", "c"]
    assert [len(p.row.seconds) for p in rows] == [3, 3, 3] and closed == ["a", "b", "c"]
    # A failing row still lets go of every engine.
    calls.clear(), closed.clear()
    with pytest.raises(RuntimeError, match="engine failed"):
        time_in_rounds([prepared("a"), prepared("b", fail_at=4)], repeats=2, log=lambda line: None)
    assert closed == ["a", "b"]
    # Ratios pair the rounds: ours twice as fast in round 1, 1.5x in round 2, 1.25x in round 3.
    ours = PeerRow(PeerWorkload("a", "decode", "minimind", "fp32"), seconds=[1.0, 2.0, 4.0], tokens=100)
    theirs = PeerRow(PeerWorkload("b", "decode", "llama.cpp", "f32"), seconds=[2.0, 3.0, 5.0], tokens=100)
    assert paired_ratio(ours, theirs) == (1.5, 1.25, 2.0)
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter than argument 1"):  # unpaired rounds
        paired_ratio(ours, PeerRow(theirs.workload, seconds=[2.0], tokens=100))


def test_header_names_the_cpu_kernels_each_side_was_built_for(monkeypatch):
    """llama.cpp's version with the vector extensions its library reports (an AVX2-only build loaded through
    LLAMA_CPP_LIB_PATH stands for an AVX2-only CPU), and oneDNN's ISA cap where one is set."""
    import sys
    import types

    from bench.llama_cpp import llama_cpp_version

    info = (
        b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 0 | OPENMP = 1 | "
    )
    fake = types.SimpleNamespace(__version__="0.3.36", llama_print_system_info=lambda: info)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert llama_cpp_version() == "0.3.36 (CPU kernels: AVX, AVX2, F16C, FMA)"
    fake.llama_print_system_info = lambda: b"CPU : LLAMAFILE = 1 | "
    assert llama_cpp_version() == "0.3.36"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert machine_details()["oneDNN ISA cap"] == "AVX2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert "oneDNN ISA cap" not in machine_details()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert machine_details()["MKL instructions cap"] == "AVX2"
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert "MKL instructions cap" not in machine_details()
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    assert machine_details()["fbgemm instructions cap"] == "AVX2"


def test_run_details_say_how_the_heap_is_kept(monkeypatch):
    """The benchmark keeps the heap as the inference commands do, and its run details say so, or what the user set."""
    import minimind.heap
    from bench.measure import run_details

    cpu = torch.device("cpu")
    monkeypatch.setattr(minimind.heap, "_kept", True)
    assert run_details(cpu)["heap"] == (
        "freed memory kept for reuse, as the inference commands keep it (minimind.heap.keep_heap)"
    )
    monkeypatch.setattr(minimind.heap, "_kept", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert run_details(cpu)["heap"] == "glibc's thresholds as set: MALLOC_TRIM_THRESHOLD_=131072"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert run_details(cpu)["heap"] == "the C library's defaults"


@pytest.mark.skipif(bool(serving_missing()), reason=serving_missing() or "")
def test_server_runs_in_a_process_of_its_own(tmp_path):
    """The serve rows' server is `minimind-serve` in another process, answering on the URL it yields and gone
    after the rows; a server that cannot start is reported with its exit code and its own last lines."""
    import types

    import httpx

    from bench.serve import server_process
    from conftest import model_dir

    model_dir(tmp_path / "model")
    ctx = types.SimpleNamespace(
        model_dir=str(tmp_path / "model"),
        sizes=dict(new_tokens=4),
        settings=types.SimpleNamespace(quick=True),
        threads=1,
        workdir=str(tmp_path),
        log=lambda line: None,
    )
    with server_process(ctx, "fp32", "paged") as (url, ready):
        assert [model["id"] for model in httpx.get(f"{url}/v1/models").json()["data"]] == ["peers"]
        assert ready > 0
    # uvicorn's start-up line, which only a server process of its own writes to the log
    assert f"Uvicorn running on {url}" in (tmp_path / "serve-fp32-paged.log").read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v1/models")
    ctx.model_dir = str(tmp_path / "missing")
    with pytest.raises(RuntimeError, match=r"minimind-serve exited with code 2 before answering") as error:
        with server_process(ctx, "bf16", "compiled"):
            pass
    assert str(error.value).endswith(f"):\nerror: no such directory: {ctx.model_dir}\n")


def test_server_process_runs_this_checkout_with_the_benchmarks_threads(monkeypatch, tmp_path):
    """The serve rows' server is this checkout's serve command, importing this checkout's package first (a user's
    own PYTHONPATH after it), with the benchmark's thread count and the rows' limits."""
    import types

    import bench.serve

    launched = []

    class Exited:  # a server that exits at once
        returncode = 3

        def __init__(self, command, env, **kwargs):
            launched.append((command, env))

        def poll(self):
            return self.returncode

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return self.returncode

    monkeypatch.setattr(bench.serve.subprocess, "Popen", Exited)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    ctx = types.SimpleNamespace(
        model_dir="/models/peers",
        sizes=dict(new_tokens=128),
        settings=types.SimpleNamespace(quick=False),
        threads=2,
        workdir=str(tmp_path),
    )
    with pytest.raises(RuntimeError, match=r"^minimind-serve exited with code 3 before answering"):
        with bench.serve.server_process(ctx, "bf16", "compiled"):
            pass
    [(command, env)] = launched
    assert command[1] == os.path.join(ROOT, "scripts", "serve.py")
    assert env["PYTHONPATH"] == os.pathsep.join([ROOT, "/elsewhere"]) and env["OMP_NUM_THREADS"] == "2"
    flags = dict(zip(command[2::2], command[3::2]))
    assert flags == {
        "--model_name_or_path": "/models/peers",
        "--served_model_name": "peers",
        "--device": "cpu",
        "--dtype": "bfloat16",
        "--engine": "compiled",
        "--port": flags["--port"],
        "--max_context": "256",
        "--max_tokens": "128",
        "--default_max_tokens": "128",
        "--max_concurrent_requests": "8",
        "--max_batch": "8",
    }
    assert 0 < int(flags["--port"]) < 65536 and len(command) == 2 + 2 * len(flags)  # compiled: no --no-compile
