"""`minimind.decode.CompiledDecoder` against `model.generate` on tiny models: the same tokens, greedy and sampled,
with the same stopping rules; compiled (fp32, one row and a server's rows) as well as eager. Which kernels the
compiled steps run (each CPU maker's fp32 table, bf16, int8): tests/decode/test_kernels.py."""

import contextlib
import json
import os
import zipfile

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from conftest import (
    BATCH,
    NO_EOS,
    PROMPT,
    batch_reference,
    collapses_memory,
    greedy,
    mapping_holding,
    pages_holding,
    reference,
    resident_kb,
    tiny_model,
    transparent_huge_pages,
)
from minimind.decode import (
    CACHE_BUCKET,
    GROUPED_QUERY_SDPA,
    CompiledDecoder,
    RowCache,
    RowDecoder,
    _attends_written_part,
    cache_length,
    fp32_product_kernel,
    grouped_query_sdpa,
)
from minimind.decode.memory import HUGE_PAGE
from minimind.hardware import CAP_VARIABLES


@pytest.fixture(autouse=True)
def compile_cache(tmp_path, monkeypatch):
    """Each test's compiled steps go to a directory of its own: a package left by another test (or by the user's
    commands) would turn a compilation under test into a load."""
    directory = tmp_path / "compiled"
    monkeypatch.setenv("MINIMIND_COMPILE_CACHE", str(directory))
    return directory


@pytest.fixture(scope="module")
def model():
    return tiny_model(std=0.3)


def entry_of(decoder, batch=1, needed=64):
    """What names the package entry of `decoder`'s step for `batch` rows and a cache of `needed` positions."""
    token, position, cache = decoder._example(batch, needed)
    return decoder._material(decoder._step_inputs(token, position, cache), batch)


def no_compiling(*args, **kwargs):
    """Patched over torch.export and AOTInductor where a step must be loaded, not built."""
    raise AssertionError("compiled again")


def test_cache_lengths_round_up_to_the_bucket():
    assert [cache_length(n) for n in (1, CACHE_BUCKET, CACHE_BUCKET + 1)] == [
        CACHE_BUCKET,
        CACHE_BUCKET,
        2 * CACHE_BUCKET,
    ]


def test_grouped_sdpa_equals_transformers_sdpa(model, monkeypatch):
    """One query position: the same output as transformers' SDPA kernel (which copies each key/value head to every
    query head it serves), without that copy; several positions go to transformers' kernel unchanged."""
    import transformers.integrations.sdpa_attention as sdpa

    layer = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, kv_heads, dim = 3, 11, 4, 2, 16
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    mask = torch.rand(batch, 1, 1, length, generator=generator) > 0.3
    mask[..., 0] = True
    theirs, _ = sdpa.sdpa_attention_forward(layer, query, key, value, mask, scaling=dim**-0.5)

    def no_copies(*args):
        raise AssertionError("the key/value heads were copied")

    monkeypatch.setattr(sdpa, "repeat_kv", no_copies)
    ours, weights = grouped_query_sdpa(layer, query, key, value, mask, scaling=dim**-0.5)
    assert ours.shape == theirs.shape == (batch, 1, heads, dim) and weights is None
    assert (ours - theirs).abs().max().item() < 1e-6
    with pytest.raises(AssertionError, match="copied"):  # two query positions: transformers' kernel, copy included
        grouped_query_sdpa(layer, query.repeat(1, 1, 2, 1), key, value, mask.repeat(1, 1, 2, 1), scaling=0.25)


def test_grouped_sdpa_reads_only_seen_positions(model):
    """A static cache is longer than what has been written. Poisoned with NaN past the last position any row sees,
    transformers' kernel returns NaN (a masked value still enters the weighted sum as 0 x NaN); the grouped one
    equals transformers' on the clean cache."""
    import transformers.integrations.sdpa_attention as sdpa

    layer = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    batch, length, filled, heads, kv_heads, dim = 2, 16, 9, 4, 2, 8
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    query = torch.randn(batch, heads, 1, dim, generator=generator)
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    mask[0, ..., : filled - 2] = True
    mask[1, ..., 3:filled] = True  # the rows end at different places: the longer one decides
    clean, _ = sdpa.sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    for tensor in (key, value):
        tensor[:, :, filled:] = float("nan")
    poisoned, _ = sdpa.sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert poisoned.isnan().all()
    ours, _ = grouped_query_sdpa(layer, query, key, value, mask, scaling=0.3)
    assert (ours - clean).abs().max().item() < 1e-6
    # Only a bool mask on the CPU: elsewhere the length would cost a device sync per layer.
    assert _attends_written_part(mask) and not _attends_written_part(mask.float())
    assert not _attends_written_part(mask.to("meta")) and not _attends_written_part(None)


def attention_inputs(seed, batch=3, length=13, heads=4, kv_heads=2, dim=16, dtype=torch.float32):
    """Grouped queries [B, K, G, Dh], keys and values [B, K, S, Dh] and a bool mask [B, 1, 1, S] with holes, its
    rows seeing different lengths of the cache."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads, heads // kv_heads, dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype) for _ in range(2))
    mask = torch.rand(batch, 1, 1, length, generator=generator) > 0.3
    mask[..., 0] = True
    mask[1, ..., length // 2 :] = False
    return query, key, value, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summed_attention_equals_sdpa(dtype):
    """The sums a compiled CPU step attends with give SDPA's output: fp32 to rounding, 16-bit inputs to the last
    bit of a bfloat16 (both accumulate in fp32)."""
    from minimind.decode.attention import summed_attention

    query, key, value, mask = attention_inputs(2, dtype=dtype)
    for attn_mask in (mask, None):
        theirs = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=0.3)
        ours = summed_attention(query, key, value, attn_mask, 0.3)
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (3, 2, 2, 16)
        tolerance = 1e-6 if dtype == torch.float32 else 2**-7 * theirs.abs().max().item()
        assert (ours - theirs.float()).abs().max().item() < tolerance


def test_compiled_steps_attend_as_sums(model):
    """In a graph compiled for the CPU the grouped kernel attends as sums, its query computed into memory, with no
    SDPA call left for inductor to make; the output is eager SDPA's."""
    layer = model.model.layers[0].self_attn
    query, key, value, mask = attention_inputs(3)
    query = query.reshape(3, 4, 1, 16)  # [B, H, 1, Dh]
    targets = []

    def recording(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    attend = lambda *inputs: grouped_query_sdpa(layer, *inputs, scaling=0.3)[0]  # noqa: E731
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as the decoder compiles its steps
        compiled = torch.compile(attend, backend=recording, fullgraph=True)(query, key, value, mask)
    torch._dynamo.reset()
    assert torch.ops.prims.inductor_force_stride_order.default in targets
    assert torch.nn.functional.scaled_dot_product_attention not in targets
    assert (compiled - attend(query, key, value, mask)).abs().max().item() < 1e-6


def test_steps_use_grouped_kernel(model, monkeypatch):
    """Decode steps attend through the grouped kernel and leave the model as it was."""
    from transformers import AttentionInterface

    calls = []
    grouped = AttentionInterface._global_mapping[GROUPED_QUERY_SDPA]
    monkeypatch.setitem(
        AttentionInterface._global_mapping,
        GROUPED_QUERY_SDPA,
        lambda *args, **kwargs: calls.append(args[1].shape) or grouped(*args, **kwargs),
    )
    out = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=5, **greedy())
    assert torch.equal(out, reference(model, 5, **greedy()))
    # the prompt runs through the model's own kernel, each of the 4 steps through the grouped one in every layer
    assert calls == [(1, model.config.num_attention_heads, 1, model.config.head_dim)] * (
        4 * model.config.num_hidden_layers
    )
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model(std=0.3, attn_implementation="eager")
    assert CompiledDecoder(eager, compile=False).step_attention == "eager"  # a model's own non-SDPA kernel stays


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads resident memory from Linux's /proc")
def test_a_reply_holds_only_the_cache_positions_it_wrote(model):
    """The static cache spans a whole bucket, resident only in the pages of the positions written (neither the
    prompt, causal from the cache's start, nor a step reads further), and the next reply starts from none."""
    decoder = CompiledDecoder(model, compile=False)
    for prompt, new in ((PROMPT, 100), (torch.tensor([[9, 9, 1, 2]]), 20)):
        out = decoder.generate(prompt, max_new_tokens=new, **greedy())
        with torch.no_grad():
            theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, **greedy())
        assert torch.equal(out, theirs)
        written = prompt.shape[1] + new - 1  # the last token is never fed back
        for layer in decoder._cache.layers:
            assert layer.keys.shape[2] == CACHE_BUCKET
            for tensor in (layer.keys, layer.values):
                assert resident_kb(tensor) == 4 * pages_holding(tensor, written)
    assert 4 * pages_holding(layer.keys, 106) == 16 and 4 * pages_holding(layer.keys, CACHE_BUCKET) == 128


def test_eager_loop_matches_greedy_generate(model):
    out = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=40, **greedy())
    assert out.shape == (1, PROMPT.shape[1] + 40)
    assert torch.equal(out, reference(model, 40, **greedy()))


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.7, top_k=None, top_p=0.9),
        dict(temperature=1.3, top_k=5, top_p=None),
        dict(temperature=1.0, top_k=None, top_p=1.0),
    ],
)
def test_eager_loop_samples_as_generate_does(model, sampling):
    decoder = CompiledDecoder(model, compile=False)
    torch.manual_seed(123)
    ours = decoder.generate(PROMPT, max_new_tokens=30, do_sample=True, eos_token_id=NO_EOS, **sampling)
    torch.manual_seed(123)
    theirs = reference(model, 30, do_sample=True, **sampling)
    assert torch.equal(ours, theirs)
    torch.manual_seed(124)
    assert not torch.equal(
        decoder.generate(PROMPT, max_new_tokens=30, do_sample=True, eos_token_id=NO_EOS, **sampling), ours
    )


def test_eos_and_stopping_criteria_end_reply(model):
    """eos and stopping criteria end the reply as in generate."""
    decoder = CompiledDecoder(model, compile=False)
    plain = decoder.generate(PROMPT, max_new_tokens=20, **greedy())
    eos = int(plain[0, PROMPT.shape[1] + 5])
    first = PROMPT.shape[1] + plain[0, PROMPT.shape[1] :].tolist().index(eos)
    out = decoder.generate(PROMPT, max_new_tokens=20, **greedy(eos_token_id=eos))
    assert torch.equal(out, plain[:, : first + 1])
    assert torch.equal(out, reference(model, 20, **greedy(eos_token_id=eos)))

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] >= PROMPT.shape[1] + 3])

    out = decoder.generate(
        PROMPT, max_new_tokens=20, stopping_criteria=StoppingCriteriaList([AfterThree()]), **greedy()
    )
    assert torch.equal(out, plain[:, : PROMPT.shape[1] + 3])


def test_batch_rows_end_at_eos_padded_as_generate(model):
    """A batch ends rows at eos and pads them as generate does."""
    decoder = CompiledDecoder(model, compile=False)
    plain = decoder.generate(BATCH, max_new_tokens=16, **greedy())
    assert torch.equal(plain, batch_reference(model, 16, pad_token_id=0, **greedy()))
    # An eos the second row produces early: that row is padded from there on, the others run to the end.
    eos = int(plain[1, BATCH.shape[1] + 3])
    out = decoder.generate(BATCH, max_new_tokens=16, pad_token_id=0, **greedy(eos_token_id=eos))
    assert torch.equal(out, batch_reference(model, 16, pad_token_id=0, **greedy(eos_token_id=eos)))
    assert (out[1, BATCH.shape[1] + 4 :] == 0).all() and out[1, BATCH.shape[1] + 3] == eos

    class RowsAfter(StoppingCriteria):  # the given rows stop once they hold `new` generated tokens
        def __init__(self, rows, new):
            self.rows, self.new = rows, new

        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[self.rows] = input_ids.shape[1] >= BATCH.shape[1] + self.new
            return done

    for rows, new in (([1], 2), ([0, 1, 2], 3)):  # one row padded after 2 tokens; every row ended: the loop stops
        criteria = StoppingCriteriaList([RowsAfter(rows, new)])
        out = decoder.generate(BATCH, max_new_tokens=16, pad_token_id=0, stopping_criteria=criteria, **greedy())
        assert torch.equal(out, batch_reference(model, 16, pad_token_id=0, stopping_criteria=criteria, **greedy()))
    assert out.shape == (3, BATCH.shape[1] + 3)


def test_streamer_gets_prompt_then_each_token(model):
    from conftest import TOKENIZER_DIR
    from minimind.tokenizer import load_tokenizer

    big = tiny_model(std=0.3, vocab_size=6400)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = CompiledDecoder(big, compile=False).generate(PROMPT, max_new_tokens=12, streamer=streamer, **greedy())
    assert "".join(streamer) == tokenizer.decode(out[0, PROMPT.shape[1] :], skip_special_tokens=True)


def test_refuses_what_it_does_not_cover(model):
    decoder = CompiledDecoder(model, compile=False)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\], got \[7\]"):
        decoder.generate(PROMPT[0], max_new_tokens=4)
    with pytest.raises(
        ValueError, match="a streamer takes one sequence, got a batch of 2; stream one prompt at a time"
    ):
        decoder.generate(PROMPT.repeat(2, 1), max_new_tokens=4, streamer=object())
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        mask = torch.ones_like(PROMPT)
        mask[0, 0] = 0
        decoder.generate(PROMPT, mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        decoder.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"needs a model in eval mode: call model.eval\(\) first"):
        CompiledDecoder(tiny_model().train())


def test_failed_compile_warns_and_runs_eager(model):
    """A machine without a C++ compiler fails inside inductor at the first decode step; the reply goes on."""
    decoder = CompiledDecoder(model)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    decoder._step = decoder._compile_package = no_compiler
    with pytest.warns(UserWarning) as warned:
        out = decoder.generate(PROMPT, max_new_tokens=12, **greedy())
    # the package first, then torch.compile in the process, then no compilation
    assert [str(w.message) for w in warned if "decode step" in str(w.message)] == [
        "could not build an AOTInductor package of the decode step (RuntimeError: InvalidCxxCompiler: No working "
        "C++ compiler found); compiling it with torch.compile, at every start",
        "torch.compile could not build the decode step (RuntimeError: InvalidCxxCompiler: No working C++ compiler "
        "found); decoding without compilation from here on (minimind-chat --no-compile skips the try)",
    ]
    assert decoder.compiled is False and decoder.backend == "inductor"
    assert torch.equal(out, CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=12, **greedy()))


def test_prepare_compiles_a_step_that_cannot_be_packaged(model, monkeypatch):
    """A step that cannot be packaged (tensor subclasses, which do not export) is compiled by torch.compile in
    `prepare`'s background thread too; the next reply compiles nothing and decodes generate's tokens."""
    from minimind.decode import compiled

    monkeypatch.setattr(compiled, "_exportable", lambda model: False)
    decoder = CompiledDecoder(model)
    assert decoder.backend == "inductor" and decoder._step is None
    decoder.prepare(1, CACHE_BUCKET, background=True)
    decoder.wait_prepared()
    built = decoder.compile_seconds
    assert built > 0 and decoder._step is not None
    out = decoder.generate(PROMPT, max_new_tokens=12, **greedy())
    assert decoder.compile_seconds == built  # the reply's steps ran the graph prepared on its cache
    assert torch.equal(out, reference(model, 12))


@pytest.mark.slow
def test_steps_compiled_in_the_process_skip_inductors_caches_under_cpu_caps(monkeypatch):
    """Inductor's graph cache and its cache of autotuning times leave the environment's CPU caps out of their keys
    (under ATEN_CPU_CAPABILITY=avx2 the graph cache loaded AVX-512 kernels an uncapped process had built, and
    autotuning weighed times taken under different caps): under a cap, a step torch.compile builds in the process
    is compiled and autotuned afresh, neither cache read. Uncapped, the same step compiled again is a graph cache
    hit and autotuning reads its times: the caches are in play."""
    pytest.importorskip("torchao")
    from torch._dynamo.utils import counters
    from torch._inductor.codecache import CacheBase

    from minimind.decode import compiled, quantize_weights_int8

    monkeypatch.setattr(compiled, "_exportable", lambda model: False)  # compiled in the process
    # int8 weights: autotuned products
    model = quantize_weights_int8(tiny_model(std=0.3).to(torch.bfloat16))
    for name in CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    reads = []
    read = CacheBase.get_local_cache
    monkeypatch.setattr(CacheBase, "get_local_cache", lambda self: reads.append(1) or read(self))

    def compiled_in_the_process():
        decoder = CompiledDecoder(model)
        counters.clear()
        reads.clear()
        tokens = decoder.generate(PROMPT, max_new_tokens=4, **greedy())
        assert decoder.backend == "inductor" and decoder.compiled
        return tokens, counters["inductor"]["fxgraph_cache_hit"], len(reads)

    first, _, _ = compiled_in_the_process()
    again, hits, _ = compiled_in_the_process()
    assert hits == 1 and torch.equal(again, first)
    with torch._inductor.config.patch(fx_graph_cache=False):  # built afresh: autotuning runs and reads its times
        _, _, timings_read = compiled_in_the_process()
    assert timings_read > 0
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # a cap with no effect on the code: only keys are at stake
    capped, hits, capped_timings_read = compiled_in_the_process()
    assert hits == 0 and torch.equal(capped, first)
    assert capped_timings_read == 0


def poison_unwritten_positions(decoder, monkeypatch):
    """Before each step, NaN in every cache position past the last one the step writes (rows at their own positions:
    the furthest): a step that read any of them would turn its logits to NaN."""
    step = decoder._next_logits

    def poisoned(token, position, cache):
        unwritten = position.max().item() + 1
        for layer in cache.layers:
            layer.keys[:, :, unwritten:] = float("nan")
            layer.values[:, :, unwritten:] = float("nan")
        logits = step(token, position, cache)
        for layer in cache.layers:  # a row that later moves on past here finds stale numbers there, as it would
            layer.keys[:, :, unwritten:] = 0.0
            layer.values[:, :, unwritten:] = 0.0
        return logits

    monkeypatch.setattr(decoder, "_next_logits", poisoned)


@pytest.mark.slow
def test_compiled_fp32_equals_generate(model, monkeypatch):
    """Also: one graph serves every step of a bucket although each step attends a different length of the cache,
    and no step reads past the positions written."""
    decoder = CompiledDecoder(model)
    poison_unwritten_positions(decoder, monkeypatch)
    assert decoder.inductor_settings(1)["cpp.weight_prepack"] is True and decoder.inductor_settings(1)["freezing"]
    # autotuning only paid off for 16-bit; where fp32's one row takes inductor's template it is the only choice
    template = fp32_product_kernel(1) == "template"
    assert decoder.inductor_settings(1)["max_autotune"] is template
    assert decoder.inductor_settings(1)["max_autotune_gemm_backends"] == ("CPP" if template else "CPP,ATEN")
    out = decoder.generate(PROMPT, max_new_tokens=40, **greedy())
    assert torch.equal(out, reference(model, 40, **greedy()))
    assert decoder.compile_seconds > 0
    first_compile = decoder.compile_seconds
    # A different prompt in the same cache bucket reuses the compiled step.
    other = torch.tensor([[9, 9, 1, 2]])
    ours = decoder.generate(other, max_new_tokens=25, **greedy())
    with torch.no_grad():
        theirs = model.generate(
            other, attention_mask=torch.ones_like(other), max_new_tokens=25, pad_token_id=0, **greedy()
        )
    assert torch.equal(ours, theirs)
    assert decoder.compile_seconds == first_compile
    # A batch of three prompts is a new graph; its rows are generate's.
    batched = decoder.generate(BATCH, max_new_tokens=30, **greedy())
    assert torch.equal(batched, batch_reference(model, 30, pad_token_id=0, **greedy()))
    assert decoder.compile_seconds > first_compile


ROW_PROMPTS = [[5, 17, 3, 42, 8], [9, 9, 1, 2, 30, 31, 32, 33, 12], [7, 4, 6], [50, 51, 52, 53, 54, 55, 56]]


def decode_rows_as_a_server_does(decoder, model):
    """Sequences join a `RowCache` one after another, each at its own position, finish at different steps and
    hand their rows over (`move_row`); the steps run over 1, 2 or 4 rows. Returns each sequence's greedy tokens."""
    cache = RowCache(model.config, rows=4, length=64, dtype=torch.float32, device="cpu")
    views = {rows: cache.first(rows) for rows in (1, 2, 4)}
    joins = {0: [0], 3: [1], 5: [2, 3]}  # step -> sequences that join before it
    budget = [14, 12, 6, 9]  # new tokens each sequence generates
    busy, tokens = [], {i: [] for i in range(len(ROW_PROMPTS))}  # busy: the sequence in each row, rows in order
    for step in range(40):
        joining = joins.get(step, [])
        if joining:  # prompts of different lengths prefilled together
            logits = decoder.prefill(
                [ROW_PROMPTS[s] for s in joining], cache, list(range(len(busy), len(busy) + len(joining)))
            )
            busy += joining
            for sequence, row_logits in zip(joining, logits):
                tokens[sequence].append(int(row_logits.argmax()))
        for row in reversed(range(len(busy))):
            if len(tokens[busy[row]]) == budget[busy[row]]:
                last = len(busy) - 1
                if row != last:
                    cache.move_row(last, row)
                busy[row] = busy[last]
                busy.pop()
                cache.positions[last] = 0
        if not busy:
            break
        rows = next(n for n in (1, 2, 4) if n >= len(busy))
        step_tokens = torch.zeros(rows, 1, dtype=torch.long)
        step_tokens[: len(busy), 0] = torch.tensor([tokens[s][-1] for s in busy])
        logits = decoder.step(step_tokens, views[rows])
        cache.positions[: len(busy)] += 1
        for row, sequence in enumerate(busy):
            tokens[sequence].append(int(logits[row].argmax()))
    assert all(len(tokens[s]) == budget[s] for s in tokens)
    return [tokens[s] for s in range(len(ROW_PROMPTS))]


def alone(model, prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, pad_token_id=0, **greedy())
    return out[0, len(prompt) :].tolist()


def test_rows_at_own_positions_decode_as_alone(model):
    """Rows at their own positions each decode as their prompt alone."""
    rows = decode_rows_as_a_server_does(RowDecoder(model, compile=False), model)
    assert rows == [alone(model, prompt, len(tokens)) for prompt, tokens in zip(ROW_PROMPTS, rows)]


def test_row_cache_views_rows_and_moves_sequences(model):
    """A row cache views its first rows and moves a sequence between rows."""
    config = model.config
    cache = RowCache(config, rows=4, length=16, dtype=torch.float32, device="cpu")
    cache.keys.normal_()
    cache.positions[3] = 5
    first = cache.first(2)
    assert first.keys.data_ptr() == cache.keys.data_ptr() and first.positions.data_ptr() == cache.positions.data_ptr()
    assert first.layers[1].keys.shape == (2, config.num_key_value_heads, 16, config.head_dim)
    cache.move_row(3, 1)
    assert cache.positions.tolist() == [0, 5, 0, 5]
    assert torch.equal(cache.keys[:, 1, :, :5], cache.keys[:, 3, :, :5])
    assert not torch.equal(cache.keys[:, 1, :, 5:], cache.keys[:, 3, :, 5:])  # only what was written moves


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads resident memory from Linux's /proc")
def test_row_cache_is_resident_only_where_rows_are_written(model):
    """A server's row cache spans every row for the whole context; only the pages a prompt or a moved sequence
    writes become resident."""
    config = model.config
    cache = RowCache(config, rows=4, length=CACHE_BUCKET, dtype=torch.float32, device="cpu")
    assert resident_kb(cache.keys) == resident_kb(cache.values) == 0
    prompt = torch.arange(100)[None] % config.vocab_size
    with torch.no_grad():
        prompt_cache = model(prompt, use_cache=True).past_key_values
    cache.fill_row(2, prompt_cache, 0, 100)
    # 100 positions of 16 floats: 2 pages for each of 2 layers x 2 key/value heads
    pages = config.num_hidden_layers * config.num_key_value_heads * -(-100 * config.head_dim * 4 // 4096)
    assert resident_kb(cache.keys) == resident_kb(cache.values) == 4 * pages == 32
    cache.move_row(2, 0)
    assert resident_kb(cache.keys) == 2 * 4 * pages
    assert torch.equal(cache.keys[:, 0, :, :100], cache.keys[:, 2, :, :100])


def test_row_step_writes_each_layer_into_its_own_input(model):
    """The row step's package takes a cache tensor per layer, views of the cache's own memory, and writes each in
    place. Exported over one [layers, ...] tensor, every layer's write became a copy of that tensor and a copy
    back on every step."""
    from minimind.decode.compiled import _ExportedStep

    layers = model.config.num_hidden_layers
    decoder = RowDecoder(model)
    cache = RowCache(model.config, rows=2, length=16, dtype=torch.float32, device="cpu")
    inputs = decoder._step_inputs(torch.zeros(2, 1, dtype=torch.long), cache.positions, cache)
    assert [t.data_ptr() for t in inputs[2:]] == [t.data_ptr() for t in (*cache.keys, *cache.values)]
    with torch.no_grad(), decoder._step_kernel(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        program = torch.export.export(
            _ExportedStep(decoder, cache, 2), (inputs[0], inputs[1], inputs[2:]), strict=False
        )
    written = [
        node.args[0]
        for node in program.graph.nodes
        if node.op == "call_function" and node.target == torch.ops.aten.index_put_.default
    ]
    assert sorted(node.name for node in written) == [f"state_{i}" for i in range(2 * layers)]  # inputs, not views
    assert {tuple(node.meta["val"].shape) for node in written} == {
        (2, model.config.num_key_value_heads, 16, model.config.head_dim)
    }


@pytest.mark.slow
def test_row_steps_equal_generate(model, monkeypatch):
    """Compiled row steps equal generate, with one package per batch size."""
    decoder = RowDecoder(model)
    poison_unwritten_positions(decoder, monkeypatch)
    rows = decode_rows_as_a_server_does(decoder, model)
    assert rows == [alone(model, prompt, len(tokens)) for prompt, tokens in zip(ROW_PROMPTS, rows)]
    assert decoder.packages.built == len(decoder._packaged) == 3  # 1, 2 and 4 rows
    assert decode_rows_as_a_server_does(decoder, model) == rows  # a new cache, the same batch sizes: nothing new
    assert decoder.packages.built == len(decoder._packaged) == 3 and decoder.packages.loaded == 0


@pytest.mark.slow
def test_int8_one_row_steps_are_packaged_over_the_int8_values(compile_cache, monkeypatch):
    """torchao's int8 weights are tensor subclasses, which do not export: the one-row step runs the same int8 values
    and scales as plain tensors (`weight_only_int8_view`), which do. Every product of the packaged graph stays a
    weight-only int8 product (none over a 16-bit copy of a weight); the tokens are the torch.compile'd step's; a
    later decoder loads the package and decodes the same; an int8 value changed is another entry."""
    pytest.importorskip("torchao")
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from minimind.decode import compiled, quantize_weights_int8

    model = quantize_weights_int8(tiny_model(std=0.3).to(torch.bfloat16))
    decoder = CompiledDecoder(model)
    assert decoder.backend == "aoti" and decoder.model_for(1) is decoder.plain_model
    products = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            kinds = ("mm", "linear", "woq_int8")  # ATen's products, oneDNN's and MKL's linears, the int8 lowering
            targets = [str(node.target) for node in graph.nodes]
            products.extend(target for target in targets if any(kind in target for kind in kinds))

        def uuid(self):
            return get_hash_for_files((__file__,))

    with torch._inductor.config.patch(post_grad_custom_post_pass=Record(), fx_graph_cache=False):
        out = decoder.generate(PROMPT, max_new_tokens=12, **greedy())
    assert (decoder.packages.built, decoder.packages.loaded) == (1, 0)
    # each of the 7 projections per layer and the head, q/k/v and gate/up merged where inductor merges them
    assert products and all("woq_int8" in target or "_weight_int8pack_mm" in target for target in products)
    with monkeypatch.context() as patch:
        patch.setattr(compiled, "_exportable", lambda model: False)
        in_process = CompiledDecoder(model)
        assert torch.equal(in_process.generate(PROMPT, max_new_tokens=12, **greedy()), out)
        assert in_process.backend == "inductor" and in_process.packages.built == 0

    with monkeypatch.context() as patch:
        patch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
        patch.setattr(torch.export, "export", no_compiling)
        later = CompiledDecoder(model)
        assert later.is_packaged(1, PROMPT.shape[1] + 12)
        assert torch.equal(later.generate(PROMPT, max_new_tokens=12, **greedy()), out)
        assert (later.packages.built, later.packages.loaded) == (0, 1)

    before = entry_of(CompiledDecoder(model))
    model.model.layers[0].mlp.down_proj.weight.qdata[0, 0] += 1
    assert entry_of(CompiledDecoder(model)) != before


def int8_view_layers(dtype, kind):
    """The tiny model with int8 weights over `dtype` activations, its `weight_only_int8_view` (plain tensors only)
    and the view's layers by name, every projection and the head one of `kind`."""
    from minimind.decode import quantize_weights_int8
    from minimind.decode.int8 import plain_weights, weight_only_int8_view

    model = quantize_weights_int8(tiny_model(std=0.3).to(dtype))
    view = weight_only_int8_view(model)
    assert plain_weights(view)
    layers = {name: module for name, module in view.named_modules() if isinstance(module, kind)}
    assert len(layers) == 7 * model.config.num_hidden_layers + 1
    return model, view, layers


def test_int8_weights_seen_over_plain_tensors_multiply_as_torchao():
    """`weight_only_int8_view`: every int8 linear layer over the same int8 values and scales (no copy), the logits
    exactly torchao's; none for a model without int8 weights or with int8 activations, which it would multiply
    otherwise."""
    pytest.importorskip("torchao")
    from minimind.decode.int8 import Int8WeightOnlyProduct, weight_only_int8_view

    model, view, layers = int8_view_layers(torch.bfloat16, Int8WeightOnlyProduct)
    for name, layer in layers.items():
        weight = model.get_submodule(name).weight
        assert layer.qdata.data_ptr() == weight.qdata.data_ptr() and layer.scale.data_ptr() == weight.scale.data_ptr()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(view(ids).logits, model(ids).logits)
    assert weight_only_int8_view(tiny_model()) is None
    from torchao.quantization import Int8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs

    head = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(
        Int8Tensor(
            head.qdata,
            head.scale,
            head.block_size,
            head.dtype,
            head.zero_point,
            act_quant_kwargs=QuantizeTensorToInt8Kwargs(granularity=PerRow()),
        ),
        requires_grad=False,
    )
    assert weight_only_int8_view(model) is None


def test_int8_rows_of_float32_activations_multiply_as_sums_over_words():
    """With float32 activations `weight_only_int8_view` multiplies as `Int8RowSums`: word j of a row holds its int8
    values j, j + in/4, j + in/2 and j + 3 in/4, lowest byte first, the three lower ones plus 128 (0..255 as a mask
    reads them); the scales are torchao's own tensors; the logits of one row and of several are torchao's up to the
    order of float32 additions."""
    pytest.importorskip("torchao")
    from minimind.decode import Int8RowSums

    model, view, layers = int8_view_layers(torch.float32, Int8RowSums)
    for name, layer in layers.items():
        weight = model.get_submodule(name).weight
        out_features, quarter = layer.words.shape
        assert layer.words.dtype == torch.int32 and (out_features, 4 * quarter) == tuple(weight.qdata.shape)
        stored = layer.words.view(torch.uint8).view(out_features, quarter, 4)  # the lowest byte first
        values = (stored ^ torch.tensor([128, 128, 128, 0], dtype=torch.uint8)).view(torch.int8)
        assert torch.equal(values.transpose(1, 2).reshape(out_features, -1), weight.qdata)
        assert torch.equal(stored[..., :3].to(torch.int16) - 128, values[..., :3].to(torch.int16))
        assert layer.scale.data_ptr() == weight.scale.data_ptr()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (ids[:1, :1], ids):
            torch.testing.assert_close(view(rows).logits, model(rows).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_int8_one_row_steps_of_float32_activations_keep_the_words(compile_cache, monkeypatch):
    """The one-row step over `Int8RowSums` is compiled without freezing, which would fold the words' bytes into
    float32 copies of every weight, with multiply-adds fused and shared activations computed once: the packaged
    graph masks the words' bytes and has no product kernel, a later
    decoder loads every weight of the package as the model's own tensors (nothing folded is read from the archive),
    and both decode the eager step's tokens."""
    pytest.importorskip("torchao")
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from minimind.decode import Int8RowSums, packages, quantize_weights_int8

    model = quantize_weights_int8(tiny_model(std=0.3))
    decoder = CompiledDecoder(model)
    settings = decoder.inductor_settings(1)
    assert decoder.backend == "aoti" and settings["freezing"] is False
    assert settings["cpp.enable_floating_point_contract_flag"] == "fast"  # fused multiply-adds in its loops
    assert settings["realize_reads_threshold"] == 1  # shared activations computed once, not in every loop
    targets = []

    class Record(CustomGraphPass):
        def __call__(self, graph):
            targets.extend(str(node.target) for node in graph.nodes)

        def uuid(self):
            return get_hash_for_files((__file__,))

    with torch._inductor.config.patch(post_grad_custom_post_pass=Record(), fx_graph_cache=False):
        out = decoder.generate(PROMPT, max_new_tokens=12, **greedy())
    assert decoder.packages.built == 1 and any("bitwise_and" in target for target in targets)
    assert not [target for target in targets if any(kind in target for kind in ("mm", "linear", "woq_int8"))]
    eager = CompiledDecoder(model, compile=False)
    assert torch.equal(eager.generate(PROMPT, max_new_tokens=12, **greedy()), out)

    loaded = []
    weights_apart = packages._weights_apart

    def recorded(path, own):
        weights = weights_apart(path, own)
        loaded.append((weights, {tensor.data_ptr() for tensor in own.values()}))
        return weights

    with monkeypatch.context() as patch:
        patch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
        patch.setattr(torch.export, "export", no_compiling)
        patch.setattr(packages, "_weights_apart", recorded)
        later = CompiledDecoder(model)
        assert torch.equal(later.generate(PROMPT, max_new_tokens=12, **greedy()), out)
        assert (later.packages.built, later.packages.loaded) == (0, 1)
    [(weights, own)] = loaded
    words = {layer.words.data_ptr() for layer in later.plain_model.modules() if isinstance(layer, Int8RowSums)}
    assert weights and {tensor.data_ptr() for tensor in weights.values()} <= own and words <= own


def test_package_entries_name_everything_the_step_depends_on(model, monkeypatch):
    """An entry is named by the weights, dtype, shapes, torch and CPU it was built for: change any and it is another
    entry (a miss, so a new build), never the old one. A copy of the checkpoint in another directory is the same
    entry."""
    import copy

    from minimind.decode import packages

    base = entry_of(CompiledDecoder(model))
    assert entry_of(CompiledDecoder(model)) == base  # the same model, a new decoder: the same entry
    elsewhere = copy.deepcopy(model)
    elsewhere.config._name_or_path = "/a/copy/of/the/checkpoint"
    assert entry_of(CompiledDecoder(elsewhere)) == base  # where the checkpoint lies is not part of the step
    other_weights = copy.deepcopy(model)
    with torch.no_grad():
        other_weights.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    changed = {
        "weights": entry_of(CompiledDecoder(other_weights)),
        "dtype": entry_of(CompiledDecoder(copy.deepcopy(model).to(torch.bfloat16))),
        "batch": entry_of(CompiledDecoder(model), batch=2),
        "bucket": entry_of(CompiledDecoder(model), needed=CACHE_BUCKET + 1),
    }
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    changed["torch"] = entry_of(CompiledDecoder(model))
    monkeypatch.undo()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # a cap on the instructions inductor builds for
    changed["cap"] = entry_of(CompiledDecoder(model))
    monkeypatch.undo()
    monkeypatch.setattr(packages, "cpu_material", lambda: {"capability": "AVX2", "cpuinfo": {}})
    changed["cpu"] = entry_of(CompiledDecoder(model))
    names = {key: packages.entry_name(value) for key, value in changed.items()}
    assert packages.entry_name(base) not in names.values() and len(set(names.values())) == len(names)


def test_stale_or_damaged_entries_are_deleted_not_loaded(tmp_path, monkeypatch):
    """An entry whose recorded material differs from what is asked for, or whose package fails its size or checksum,
    is deleted and reported as a miss; only an intact entry for exactly this material is loaded."""
    from minimind.decode.packages import StepPackages, entry_name

    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: ("loaded", open(path, "rb").read()))
    store = StepPackages(tmp_path)
    material = {"weights": "a", "torch": torch.__version__}
    assert store.load(material) is None and not store.has(material)
    assert store.build(material, lambda path: open(path, "wb").write(b"package")) == ("loaded", b"package")
    assert store.has(material) and store.load(material) == ("loaded", b"package") and store.loaded == 1
    package, meta = store.paths(entry_name(material))
    # the same name with other material recorded (a collision, a copied file): deleted, not loaded
    meta.write_text(meta.read_text().replace('"a"', '"b"'))
    assert store.load(material) is None and not package.exists() and not meta.exists()
    for damage in (b"pack", b"pAckage"):  # truncated; same size, other bytes
        store.build(material, lambda path: open(path, "wb").write(b"package"))
        package.write_bytes(damage)
        assert store.load(material) is None and not package.exists()
    assert [reason.split(":")[0] for _, reason in store.discarded] == ["_Invalid"] * 3
    assert not list(tmp_path.glob(".*"))  # no half-written files left


def test_cache_keeps_recently_used_entries_within_limit(tmp_path, monkeypatch):
    """After a build the directory holds at most `max_bytes`: the least recently used entries go first (a load counts
    as a use), the entry just built stays even alone over the limit, and files of a build stopped over a day ago
    are deleted while a running build's are not."""
    import os

    from minimind.decode import packages
    from minimind.errors import InputError

    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: open(path, "rb").read())
    store = packages.StepPackages(tmp_path, max_bytes=2500)
    write = lambda path: open(path, "wb").write(b"x" * 1000)  # noqa: E731
    old_stray, new_stray = tmp_path / ".stopped.1.pt2", tmp_path / ".running.2.pt2"
    old_stray.write_bytes(b"half"), new_stray.write_bytes(b"half")
    os.utime(old_stray, (0, 0))
    materials = [{"weights": str(i)} for i in range(4)]
    for age, material in enumerate(materials[:2]):  # two entries (~2.3 kB with their JSON), the first older
        store.build(material, write)
        meta = store.paths(packages.entry_name(material))[1]
        os.utime(meta, (1000 + age, 1000 + age))
    assert not old_stray.exists() and new_stray.exists()
    assert store.load(materials[0]) == b"x" * 1000  # now the most recently used
    store.build(materials[2], write)  # over the limit: the least recently used goes
    assert [store.has(m) for m in materials[:3]] == [True, False, True]
    reason = "the cache is over 2.5e-06 GB; least recently used"
    assert store.discarded == [(packages.entry_name(materials[1]), reason)]
    store.max_bytes = 0
    store.build(materials[3], write)
    assert [store.has(m) for m in materials] == [False, False, False, True]
    for value, problem in (("lots", "is not a number of GB"), ("-1", "is negative")):
        monkeypatch.setenv("MINIMIND_COMPILE_CACHE_MAX_GB", value)
        with pytest.raises(InputError, match=f"MINIMIND_COMPILE_CACHE_MAX_GB='{value}' {problem}"):
            packages.StepPackages(tmp_path)
    monkeypatch.setenv("MINIMIND_COMPILE_CACHE_MAX_GB", "0.5")
    assert packages.StepPackages(tmp_path).max_bytes == 500_000_000


def _resident_kb(path, permissions):
    """Resident kB of this process' mapping of `path` with `permissions` (from /proc/self/smaps)."""
    current = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = len(fields) == 6 and fields[5] == str(path) and fields[1] == permissions
            elif current and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError(f"no {permissions} mapping of {path}")


@pytest.mark.skipif(not collapses_memory(), reason="needs MADV_COLLAPSE (Linux 6.1) and transparent huge pages")
def test_loading_a_package_moves_the_runtimes_weights_into_huge_pages(tmp_path, monkeypatch):
    """The runtime's copy of the weights of a package that holds them inside its library (new memory the load
    wrote throughout; a stand-in of 40 MiB, above the size glibc's malloc maps on its own) moves into huge pages;
    the load of a package whose weights are apart (read into huge pages already) moves nothing."""
    from minimind.decode import packages

    copies, moved, handed = [], [], []

    def aoti_load_package(path):
        copies.append(torch.full((40 << 20,), 7, dtype=torch.uint8))
        return Runner()

    class Runner:
        def load_constants(self, weights, **kwargs):
            handed.append(sorted(weights))

    real_into_huge_pages = packages.into_huge_pages
    monkeypatch.setattr(torch._inductor, "aoti_load_package", aoti_load_package)
    monkeypatch.setattr(packages, "into_huge_pages", lambda *span: moved.append(real_into_huge_pages(*span)))
    packages.load_package(tmp_path / "step.pt2")
    [copy] = copies
    assert sum(moved) >= 19 * HUGE_PAGE  # the whole huge pages of 40 MiB that start anywhere
    mapping = mapping_holding(copy.data_ptr() + 2 * HUGE_PAGE)
    assert "hg" in mapping["VmFlags"] and mapping["AnonHugePages"] >= 19 * HUGE_PAGE // 1024
    assert copy.count_nonzero().item() == copy.numel() and copy[-1].item() == 7
    moved.clear()
    monkeypatch.setattr(packages, "_weights_apart", lambda path, own: {"weight": torch.ones(3)})
    packages.load_package(tmp_path / "step.pt2")
    assert (moved, handed) == ([], [["weight"]])


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads resident memory from Linux's /proc")
@pytest.mark.parametrize("kernel_file", [None, "kernel.cubin"])
def test_loading_a_package_pages_out_its_mapped_weights(tmp_path, monkeypatch, kernel_file):
    """The AOTInductor runtime copies a package's constants out of its library at load, and the library's mapped
    copy stays resident: `load_package` pages out the non-executable mappings the load added and leaves code
    mapped. A stand-in library of 32 MiB, its halves mapped as data and as code and read in full by the load, in
    the directory the runtime unpacks a package into: deleted after the load (a process killed later would leave
    it behind), unless it holds kernel files a GPU runtime opens later."""
    import mmap

    from minimind.decode import packages

    extracted = tmp_path / "aotinductor_Ab12Cd"
    library = extracted / ".e3b0c442.zw45lua7" / "data" / "aotinductor" / "model" / "model.wrapper.so"
    library.parent.mkdir(parents=True)
    content = os.urandom(32 << 20)
    with open(library, "wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())  # clean pages, as a library's are
    if kernel_file:
        (library.parent / kernel_file).write_bytes(b"\0")
    mappings = []

    def aoti_load_package(path):
        with open(library, "rb") as file:
            for offset, protection in ((0, mmap.PROT_READ), (16 << 20, mmap.PROT_READ | mmap.PROT_EXEC)):
                mappings.append(
                    mmap.mmap(file.fileno(), 16 << 20, flags=mmap.MAP_PRIVATE, prot=protection, offset=offset)
                )
        for mapping in mappings:
            assert sum(mapping[i] for i in range(0, len(mapping), 4096)) >= 0  # touch every page
        return "runner"

    monkeypatch.setattr(torch._inductor, "aoti_load_package", aoti_load_package)
    resident = {}
    real_page_out = packages._page_out
    monkeypatch.setattr(
        packages,
        "_page_out",
        lambda m: (
            real_page_out(m),
            resident.update(data=_resident_kb(library, "r--p"), code=_resident_kb(library, "r-xp")),
        ),
    )
    assert packages.load_package(tmp_path / "step.pt2") == "runner"
    assert resident["data"] < 1024  # was 16 MiB
    assert resident["code"] == 16 << 10  # code stays
    assert extracted.exists() == bool(kernel_file)
    assert mappings[0][12345] == content[12345]  # read back from the file when touched again, its name gone or not
    assert mappings[1][(16 << 20) - 1] == content[(32 << 20) - 1]


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_packages_weights_are_read_in_place(tmp_path, monkeypatch, compression):
    """A weight kept apart is a zip archive (torch.save's) stored inside the package's zip archive. Read through
    zipfile's reader of a record, every seek backwards went back to the record's start; a record stored
    uncompressed is read in place instead, with seeks of its own, and gives the same tensor and bytes as zipfile.
    A compressed one is read whole."""
    import io

    from minimind.decode import packages

    weight = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    saved = io.BytesIO()
    torch.save(weight, saved)
    path = tmp_path / "package.pt2"
    with zipfile.ZipFile(path, "w", compression) as archive:
        archive.writestr("step/data/constants/other", b"x" * 1000)
        archive.writestr("step/data/weights/weight_0", saved.getvalue())
    seeks = []
    real_seek = zipfile.ZipExtFile.seek
    monkeypatch.setattr(zipfile.ZipExtFile, "seek", lambda self, *args: seeks.append(args) or real_seek(self, *args))
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        record = packages._record(raw, archive, "step/data/weights/weight_0")
        assert record.read() == saved.getvalue() and record.seek(-8, io.SEEK_END) == len(saved.getvalue()) - 8
        record.seek(0)
        assert torch.equal(torch.load(record, weights_only=True), weight)
        with zipfile.ZipFile(record) as inner:
            [storage] = [info.filename for info in inner.infolist() if info.filename.split("/")[-2] == "data"]
            data = packages._record(record, inner, storage)
            into = torch.empty(64 * 64 * 4, dtype=torch.uint8)
            packages._read_into(data, into, chunk=1000)
    assert torch.equal(into.view(torch.float32).reshape(64, 64), weight)
    assert (record.file is raw) == (compression == zipfile.ZIP_STORED)  # else a copy of the record in memory
    assert seeks == []  # zipfile's reader of a record, never seeking through it


def test_a_load_does_not_probe_the_cpus_vector_isas(monkeypatch):
    """Loading a package asks inductor for the CPU's vector ISA only to warn on a mismatch, and inductor tells it by
    building and loading a test library per candidate ISA in a subprocess each. The load takes the CPU's flags as
    given and forgets the answer after it, so that a step compiled later checks every ISA again."""
    from torch._inductor import cpu_vec_isa

    from minimind.decode import packages

    probes = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda self, code: probes.append(str(self)) or True)

    def forget_everything():
        packages.forget_isa_checks()
        # each ISA's base check is kept per value of `cpp.vec_isa_ok`: what the load learnt is never read without it
        cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()

    def checks(around):
        probes.clear()
        with around():
            picked = str(cpu_vec_isa.pick_vec_isa())
        return picked, len(probes)

    try:
        forget_everything()  # what the process's earlier compilations learnt
        picked, everything = checks(contextlib.nullcontext)
        assert checks(contextlib.nullcontext) == (picked, 0)  # known from here on
        forget_everything()
        loaded_picked, on_load = checks(packages._no_isa_probes)
        assert loaded_picked == picked and torch._inductor.config.cpp.vec_isa_ok is None
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
        assert checks(contextlib.nullcontext) == (picked, everything)  # forgotten: all checked again
        # where the flags name candidates, the load checked fewer of them (only extra features some ISAs check)
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            assert on_load < everything
        with packages._no_isa_probes():  # with the answers known, nothing is forgotten
            pass
        assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    finally:
        forget_everything()


def test_one_row_steps_keep_their_weights_apart_from_the_library(model, monkeypatch):
    """A one-row step's package is built with its weights as files of their own (`WEIGHTS_APART`); where that fails
    (an opaque, oneDNN-packed weight, which only the library can hold) it is built again with them inside, and a
    failure there is the build's. A step of several rows keeps them inside from the start."""
    from minimind.decode import packages

    built, failing = [], {}

    def build(program, package_path):
        apart = not torch._inductor.config.aot_inductor.package_constants_in_so
        built.append((package_path, apart))
        if apart and failing.get("error"):
            raise RuntimeError(failing["error"])

    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: "program")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", build)
    decoder = CompiledDecoder(model)
    for batch, failure, expected in (
        (1, None, [True]),
        (1, "NotImplementedError: Cannot access storage of OpaqueTensorImpl", [True, False]),
        (1, "IndexError: list index out of range", [True, False]),
        (2, None, [False]),
        (8, None, [False]),
    ):
        built.clear()
        failing["error"] = failure
        token, position, cache = decoder._example(batch, 8)
        decoder._compile_package(decoder._step_inputs(token, position, cache), cache, batch, f"step{batch}.pt2")
        assert built == [(f"step{batch}.pt2", apart) for apart in expected]
    built.clear()
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        decoder._compile_package(decoder._step_inputs(token, position, cache), cache, 1, "step.pt2")
    assert packages.WEIGHTS_APART == {
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.package_constants_on_disk_format": "pickle_weights",
    }


@pytest.mark.slow
def test_a_later_decoder_loads_the_kept_step(model, compile_cache, monkeypatch):
    """The second decoder of the same model loads the package the first one built (no export, no compilation) and
    decodes generate's tokens, its weights apart from its library and those the step holds unchanged the model's own
    tensors; a damaged package is built again. No load leaves the files the runtime unpacked
    the package into behind."""
    from minimind.decode import packages

    scratch = compile_cache.parent / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # where the runtime unpacks packages
    first = CompiledDecoder(model)
    out = first.generate(PROMPT, max_new_tokens=30, **greedy())
    assert torch.equal(out, reference(model, 30, **greedy()))
    assert (first.packages.built, first.packages.loaded) == (1, 0)
    [package] = compile_cache.glob("*.pt2")
    built = package.read_bytes()

    # The one-row step's weights are files of their own in the archive, not data in its library.
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
        [config] = [name for name in names if name.endswith("/weights_config.json")]
        recorded = json.loads(archive.read(config))
    assert len([name for name in names if "/data/weights/weight_" in name]) == len({v[0] for v in recorded.values()})
    handed = []
    real_weights_apart = packages._weights_apart
    with monkeypatch.context() as patch:
        patch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)
        patch.setattr(torch.export, "export", no_compiling)
        patch.setattr(packages, "_weights_apart", lambda *args: handed.append(real_weights_apart(*args)) or handed[-1])
        second = CompiledDecoder(model)
        assert second.is_packaged(1, PROMPT.shape[1] + 30)
        assert torch.equal(second.generate(PROMPT, max_new_tokens=30, **greedy()), out)
        assert (second.packages.built, second.packages.loaded) == (0, 1)
        assert second._step is None  # nor torch.compile's wrapper made, which alone takes memory
    # Every recorded weight handed to the runtime; those the step took over unchanged are the model's own memory:
    # the norms' weights and the embedding (under the tied head's name), none read from the archive.
    [weights] = handed
    assert sorted(weights) == sorted(recorded)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    shared = sorted(
        name
        for name, tensor in weights.items()
        if name[6:] in tensors and tensor.data_ptr() == tensors[name[6:]].data_ptr()
    )
    assert shared == sorted([f"model.{name}" for name in tensors if "norm" in name] + ["model.lm_head.weight"])
    # the others in one block, each file's weight 64-byte aligned from a start 16 bytes past a huge page, in memory
    # advised for huge pages (Linux)
    [block] = {weights[name].untyped_storage().data_ptr() for name in weights if name not in shared}
    starts = [weights[name].data_ptr() for name in recorded if name not in shared and recorded[name][3] == 0]
    assert starts and all(start % 64 == 16 for start in starts) and len(set(starts)) == len(starts)
    if transparent_huge_pages():
        assert min(starts) % HUGE_PAGE == 16 and "hg" in mapping_holding(min(starts))["VmFlags"]
    # and the runtime reads them where they are: with the final norm's weight negated in the model, the loaded
    # step decodes what generate decodes from the changed model, not the tokens of before
    with torch.no_grad():
        model.model.norm.weight.mul_(-1.0)
        try:
            changed = second.generate(PROMPT, max_new_tokens=30, **greedy())
            expected = reference(model, 30, **greedy())
        finally:
            model.model.norm.weight.mul_(-1.0)
    assert torch.equal(changed, expected) and not torch.equal(changed, out)
    package.write_bytes(built[: len(built) // 2])  # truncated
    third = CompiledDecoder(model)
    assert torch.equal(third.generate(PROMPT, max_new_tokens=30, **greedy()), out)
    assert (third.packages.built, third.packages.loaded, len(third.packages.discarded)) == (1, 0, 1)
    assert sorted(path.name for path in scratch.iterdir() if path.name.startswith("aotinductor_")) == []
