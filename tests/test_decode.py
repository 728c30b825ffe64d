"""`minimind.decode.CompiledDecoder` against `model.generate` on tiny models: the same tokens, greedy and sampled,
with the same stopping rules; compiled (fp32, and bf16 with prepacked weights) as well as eager."""

import pytest
import torch
from conftest import tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

import minimind.decode as decode
from minimind.decode import (CACHE_BUCKET, GROUPED_QUERY_SDPA, CompiledDecoder, RowCache, RowDecoder,
                             _attends_written_part, cache_length, cpu_vendor, fp32_product_kernel, grouped_query_sdpa)

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 11, 29]])
NO_EOS = 96  # an id these runs never produce, so both sides run to max_new_tokens (the tiny config's eos is 2)


def reference(model, new, **kwargs):
    with torch.no_grad():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=new,
                              pad_token_id=0, **{"eos_token_id": NO_EOS, **kwargs})


def greedy(**kwargs):
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None, **{"eos_token_id": NO_EOS, **kwargs})


@pytest.fixture(scope="module")
def model():
    return tiny_model(std=0.3)


def test_cache_lengths_round_up_to_the_bucket():
    assert [cache_length(n) for n in (1, CACHE_BUCKET, CACHE_BUCKET + 1)] == [CACHE_BUCKET, CACHE_BUCKET,
                                                                                2 * CACHE_BUCKET]


def test_grouped_query_sdpa_attends_the_cache_uncopied_and_equals_transformers_sdpa(model, monkeypatch):
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
    theirs, _ = sdpa.sdpa_attention_forward(layer, query, key, value, mask, scaling=dim ** -0.5)

    def no_copies(*args):
        raise AssertionError("the key/value heads were copied")

    monkeypatch.setattr(sdpa, "repeat_kv", no_copies)
    ours, weights = grouped_query_sdpa(layer, query, key, value, mask, scaling=dim ** -0.5)
    assert ours.shape == theirs.shape == (batch, 1, heads, dim) and weights is None
    assert (ours - theirs).abs().max().item() < 1e-6
    with pytest.raises(AssertionError, match="copied"):  # two query positions: transformers' kernel, copy included
        grouped_query_sdpa(layer, query.repeat(1, 1, 2, 1), key, value, mask.repeat(1, 1, 2, 1), scaling=0.25)


def test_grouped_query_sdpa_reads_the_cache_only_up_to_the_last_position_a_row_sees(model):
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
    mask[0, ..., :filled - 2] = True
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


def test_decode_steps_attend_through_the_grouped_kernel_and_leave_the_model_as_it_was(model, monkeypatch):
    from transformers import AttentionInterface

    calls = []
    grouped = AttentionInterface._global_mapping[GROUPED_QUERY_SDPA]
    monkeypatch.setitem(AttentionInterface._global_mapping, GROUPED_QUERY_SDPA,
                        lambda *args, **kwargs: calls.append(args[1].shape) or grouped(*args, **kwargs))
    out = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=5, **greedy())
    assert torch.equal(out, reference(model, 5, **greedy()))
    # the prompt runs through the model's own kernel, each of the 4 steps through the grouped one in every layer
    assert calls == [(1, model.config.num_attention_heads, 1, model.config.head_dim)] * (4 * model.config.num_hidden_layers)
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model(std=0.3, attn_implementation="eager")
    assert CompiledDecoder(eager, compile=False).step_attention == "eager"  # a model's own non-SDPA kernel stays


def test_eager_loop_gives_generates_greedy_tokens(model):
    out = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=40, **greedy())
    assert out.shape == (1, PROMPT.shape[1] + 40)
    assert torch.equal(out, reference(model, 40, **greedy()))


@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_k=None, top_p=0.9),
                                      dict(temperature=1.3, top_k=5, top_p=None),
                                      dict(temperature=1.0, top_k=None, top_p=1.0)])
def test_eager_loop_samples_as_generate_does(model, sampling):
    decoder = CompiledDecoder(model, compile=False)
    torch.manual_seed(123)
    ours = decoder.generate(PROMPT, max_new_tokens=30, do_sample=True, eos_token_id=NO_EOS, **sampling)
    torch.manual_seed(123)
    theirs = reference(model, 30, do_sample=True, **sampling)
    assert torch.equal(ours, theirs)
    torch.manual_seed(124)
    assert not torch.equal(decoder.generate(PROMPT, max_new_tokens=30, do_sample=True, eos_token_id=NO_EOS, **sampling), ours)


def test_eos_and_stopping_criteria_end_the_reply_as_in_generate(model):
    decoder = CompiledDecoder(model, compile=False)
    plain = decoder.generate(PROMPT, max_new_tokens=20, **greedy())
    eos = int(plain[0, PROMPT.shape[1] + 5])
    first = PROMPT.shape[1] + plain[0, PROMPT.shape[1]:].tolist().index(eos)
    out = decoder.generate(PROMPT, max_new_tokens=20, **greedy(eos_token_id=eos))
    assert torch.equal(out, plain[:, :first + 1])
    assert torch.equal(out, reference(model, 20, **greedy(eos_token_id=eos)))

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] >= PROMPT.shape[1] + 3])

    out = decoder.generate(PROMPT, max_new_tokens=20, stopping_criteria=StoppingCriteriaList([AfterThree()]),
                           **greedy())
    assert torch.equal(out, plain[:, :PROMPT.shape[1] + 3])


BATCH = torch.tensor([[5, 17, 3, 42, 8, 11, 29], [9, 9, 1, 2, 60, 7, 7], [33, 4, 4, 81, 12, 5, 70]])


def batch_reference(model, new, batch=BATCH, **kwargs):
    with torch.no_grad():
        return model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new, **kwargs)


def test_a_batch_ends_rows_at_eos_and_pads_them_as_generate_does(model):
    decoder = CompiledDecoder(model, compile=False)
    plain = decoder.generate(BATCH, max_new_tokens=16, **greedy())
    assert torch.equal(plain, batch_reference(model, 16, pad_token_id=0, **greedy()))
    # An eos the second row produces early: that row is padded from there on, the others run to the end.
    eos = int(plain[1, BATCH.shape[1] + 3])
    out = decoder.generate(BATCH, max_new_tokens=16, pad_token_id=0, **greedy(eos_token_id=eos))
    assert torch.equal(out, batch_reference(model, 16, pad_token_id=0, **greedy(eos_token_id=eos)))
    assert (out[1, BATCH.shape[1] + 4:] == 0).all() and out[1, BATCH.shape[1] + 3] == eos

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


def test_streamer_receives_the_prompt_then_each_token(model):
    from conftest import TOKENIZER_DIR

    from minimind.tokenizer import load_tokenizer

    big = tiny_model(std=0.3, vocab_size=6400)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = CompiledDecoder(big, compile=False).generate(PROMPT, max_new_tokens=12, streamer=streamer, **greedy())
    assert "".join(streamer) == tokenizer.decode(out[0, PROMPT.shape[1]:], skip_special_tokens=True)


def test_refuses_what_it_does_not_cover(model):
    decoder = CompiledDecoder(model, compile=False)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\], got \[7\]"):
        decoder.generate(PROMPT[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="a streamer takes one sequence, got a batch of 2; stream one prompt at a time"):
        decoder.generate(PROMPT.repeat(2, 1), max_new_tokens=4, streamer=object())
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        mask = torch.ones_like(PROMPT)
        mask[0, 0] = 0
        decoder.generate(PROMPT, mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        decoder.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"needs a model in eval mode: call model.eval\(\) first"):
        CompiledDecoder(tiny_model().train())


def test_a_step_that_cannot_compile_falls_back_to_the_eager_step_with_a_warning(model):
    """A machine without a C++ compiler fails inside inductor at the first decode step; the reply goes on."""
    decoder = CompiledDecoder(model)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    decoder._step = no_compiler
    with pytest.warns(UserWarning, match=r"torch.compile could not build the decode step \(RuntimeError: "
                                         r"InvalidCxxCompiler: No working C\+\+ compiler found\); decoding "
                                         r"without compilation from here on"):
        out = decoder.generate(PROMPT, max_new_tokens=12, **greedy())
    assert decoder.compiled is False
    assert torch.equal(out, CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=12, **greedy()))


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
def test_compiled_fp32_equals_generate_and_reuses_its_graph(model, monkeypatch):
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
        theirs = model.generate(other, attention_mask=torch.ones_like(other), max_new_tokens=25, pad_token_id=0, **greedy())
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
            logits = decoder.prefill([ROW_PROMPTS[s] for s in joining], cache, list(range(len(busy), len(busy) + len(joining))))
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
        step_tokens[:len(busy), 0] = torch.tensor([tokens[s][-1] for s in busy])
        logits = decoder.step(step_tokens, views[rows])
        cache.positions[:len(busy)] += 1
        for row, sequence in enumerate(busy):
            tokens[sequence].append(int(logits[row].argmax()))
    assert all(len(tokens[s]) == budget[s] for s in tokens)
    return [tokens[s] for s in range(len(ROW_PROMPTS))]


def alone(model, prompt, new):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, pad_token_id=0, **greedy())
    return out[0, len(prompt):].tolist()


def test_rows_at_their_own_positions_each_decode_as_their_prompt_alone(model):
    rows = decode_rows_as_a_server_does(RowDecoder(model, compile=False), model)
    assert rows == [alone(model, prompt, len(tokens)) for prompt, tokens in zip(ROW_PROMPTS, rows)]


def test_a_row_cache_views_its_first_rows_and_moves_a_sequence_between_rows(model):
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


@pytest.mark.slow
def test_compiled_row_steps_equal_generate_with_one_graph_per_batch_size(model, monkeypatch):
    decoder = RowDecoder(model)
    poison_unwritten_positions(decoder, monkeypatch)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows = decode_rows_as_a_server_does(decoder, model)
    assert rows == [alone(model, prompt, len(tokens)) for prompt, tokens in zip(ROW_PROMPTS, rows)]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs - before == 3  # 1, 2 and 4 rows
    assert decode_rows_as_a_server_does(decoder, model) == rows  # a new cache, the same batch sizes: no new graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def greedy_gap(model, ids, prompt_length):
    """How far each generated token's logit falls below the best one, by the model's own eager full forward:
    0 everywhere for exact greedy; small where 16-bit kernels round a near tie the other way."""
    with torch.no_grad():
        logits = model(ids).logits[0, prompt_length - 1:-1].float()  # [new, V]
    chosen = logits.gather(-1, ids[0, prompt_length:, None])[:, 0]
    return (logits.max(-1).values - chosen).max().item()


@pytest.mark.slow
@pytest.mark.kernels
def test_compiled_bf16_with_frozen_weights_decodes_greedily():
    model = tiny_model(std=0.3).to(torch.bfloat16)
    decoder = CompiledDecoder(model)
    assert decoder.inductor_settings(1)["cpp.weight_prepack"] is True and decoder.inductor_settings(1)["freezing"]
    eager = CompiledDecoder(model, compile=False)
    for prompt in (PROMPT, torch.tensor([[9, 9, 1, 2]])):  # the second reuses the cache: it must see its own prompt
        out = decoder.generate(prompt, max_new_tokens=40, **greedy())
        plain = eager.generate(prompt, max_new_tokens=40, **greedy())
        assert torch.equal(out[:, :prompt.shape[1] + 20], plain[:, :prompt.shape[1] + 20])
        assert greedy_gap(model, out, prompt.shape[1]) <= 0.0625  # two bf16 steps at these logits' size


class RecordProducts:
    """An inductor post-grad pass that records the matrix products of each graph it sees."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.mkl._mkl_linear,
                    torch.ops.mkl._mkl_linear.default, torch.ops.mkldnn._linear_pointwise.default)
        graphs = self.graphs = []

        class Record(CustomGraphPass):
            def __call__(self, graph):
                graphs.append([str(node.target) for node in graph.nodes if node.target in products])

            def uuid(self):
                return get_hash_for_files((__file__,))

        self.graph_pass = Record()


@pytest.mark.slow
@pytest.mark.kernels
def test_compiled_step_merges_projections_and_each_decoder_compiles_on_its_own():
    """With frozen weights inductor concatenates q/k/v and gate/up: 4 matrix products per layer (qkv, o, gate-up,
    down) and the LM head, against 7 per layer unmerged. The two decoders share no dynamo cache: with one graph
    allowed per code object both compile, and their graphs, frozen weights included, go with them."""
    import gc
    import weakref

    model = tiny_model(std=0.3)
    layers = model.config.num_hidden_layers
    decoders = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for merged, expected in ((True, 4 * layers + 1), (False, 7 * layers + 1)):
            record = RecordProducts()
            decoder = CompiledDecoder(model)
            settings = decoder.inductor_settings(1) | {"cpp.enable_concat_linear": merged}
            decoder.inductor_settings = lambda batch, settings=settings: settings
            with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass, fx_graph_cache=False):
                out = decoder.generate(PROMPT, max_new_tokens=3, **greedy())
            assert decoder.compiled and [len(products) for products in record.graphs] == [expected]
            assert torch.equal(out, reference(model, 3, **greedy()))
            decoders.append(decoder)
    alive = weakref.ref(model)
    del model, decoder, decoders
    gc.collect()
    assert alive() is None


def test_fp32_products_take_the_kernel_measured_fastest_for_their_rows_on_each_cpu_maker():
    rows = (1, 2, 3, 4, 8, 16)
    assert [fp32_product_kernel(n, intel=True) for n in rows] == ["plain", "mkl", "mkl", "onednn", "onednn", "onednn"]
    assert [fp32_product_kernel(n, intel=False) for n in rows] == ["template"] + ["onednn"] * 5
    assert decode.INTEL_CPU == (cpu_vendor() in ("GenuineIntel", ""))


def test_cpu_vendor_reads_cpuinfo_then_the_platform_string(monkeypatch):
    import io

    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    monkeypatch.setattr(decode, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    assert cpu_vendor() == "AuthenticAMD"

    def no_file(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(decode, "open", no_file, raising=False)
    monkeypatch.setattr(decode.platform, "processor", lambda: "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel")
    assert cpu_vendor() == "GenuineIntel"
    monkeypatch.setattr(decode.platform, "processor", lambda: "arm")
    assert cpu_vendor() == ""


def fp32_products_of_steps(model, monkeypatch, intel, batch):
    """A decoder compiled with one CPU maker's kernel table, run for 6 tokens on PROMPT and on `batch`, each checked
    against generate: the decoder, PROMPT's output, the products of the two graphs, the first graph's code."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(decode, "fp32_product_kernel", lambda rows: fp32_product_kernel(rows, intel=intel))
    record = RecordProducts()
    decoder = CompiledDecoder(model)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record.graph_pass, fx_graph_cache=False):
        out, codes = run_and_get_code(decoder.generate, PROMPT, max_new_tokens=6, **greedy())
        batched = decoder.generate(batch, max_new_tokens=6, **greedy())
    assert torch.equal(out, reference(model, 6, **greedy()))
    assert torch.equal(batched, batch_reference(model, 6, batch=batch, pad_token_id=0, **greedy()))
    return decoder, out, record.graphs, codes


@pytest.mark.slow
@pytest.mark.kernels
def test_fp32_steps_multiply_one_row_unpacked_without_copying_it_and_four_rows_with_onednn(model, monkeypatch):
    """The Intel table. fp32 at batch 1: every product is ATen's plain one (no packed MKL linear left) and a step
    copies nothing; at batch 4 every product is oneDNN's packed one. Tokens are generate's either way."""
    from torch.profiler import profile

    decoder, out, (single, batch), _ = fp32_products_of_steps(model, monkeypatch, True, torch.cat([BATCH, PROMPT]))
    layers = model.config.num_hidden_layers
    assert single == ["aten.mm.default"] * (4 * layers + 1)
    assert batch == ["mkldnn._linear_pointwise.default"] * (4 * layers + 1)
    # Inductor's one-row views have strides (0, 1), which ATen's product copies before multiplying; the pass
    # restrides them, so a step runs without a single copy.
    cache = decoder._fresh_cache(1, PROMPT.shape[1] + 6)
    decoder.generate(PROMPT, max_new_tokens=2, **greedy())
    position = torch.tensor([PROMPT.shape[1] + 1])
    cache_tensors = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values, layer.cumulative_length)]
    state = [tensor.clone() for tensor in cache_tensors]
    with profile() as trace, torch.no_grad():
        logits = decoder._next_logits(torch.tensor([[5]]), position, cache)
    assert decoder._compiled_for is cache
    assert [event.name for event in trace.events() if event.name == "aten::clone"] == []
    # Between steps only the guards that tell graphs apart run; an input no graph was built for (a token with
    # other strides) is caught and compiled for, instead of failing the reply.
    strided = torch.tensor([[4, 5]])[:, 1:]
    assert strided.stride() != (1, 1)
    for tensor, saved in zip(cache_tensors, state):
        tensor.copy_(saved)
    with torch.no_grad():
        assert torch.equal(decoder._next_logits(strided, position, cache), logits) and decoder.compiled
    # The compile settings and the attention switch are entered for a new cache only: a reply of 6 tokens on the
    # cache stepped last enters neither (patching them around each step cost 0.18 ms of a 64M fp32 token).
    entered = []
    for name in ("_compile_settings", "_step_kernel"):
        original = getattr(decoder, name)
        setattr(decoder, name, lambda *args, _name=name, _original=original: entered.append(_name) or _original(*args))
    assert torch.equal(decoder.generate(PROMPT, max_new_tokens=6, **greedy()), out)
    assert entered == []


@pytest.mark.slow
@pytest.mark.kernels
def test_fp32_steps_on_amd_multiply_one_row_in_inductors_template_and_two_rows_with_onednn(model, monkeypatch):
    """The table for other makers (AMD), where MKL runs slow. At batch 1 the packed products are left for inductor,
    which compiles each into its own C++ GEMM kernel (no call out to MKL or ATen for a product); at batch 2 every
    product is oneDNN's packed one. Tokens are generate's either way."""
    _, _, (single, pair), codes = fp32_products_of_steps(model, monkeypatch, False, BATCH[:2])
    layers = model.config.num_hidden_layers
    assert single == ["mkl._mkl_linear"] * (4 * layers + 1)
    assert pair == ["mkldnn._linear_pointwise.default"] * (4 * layers + 1)
    code = "\n".join(codes)
    assert "micro_gemm" in code and "mm_out" not in code and "_mkl_linear" not in code


def test_int8_weights_quantize_every_decoder_projection_per_row():
    pytest.importorskip("torchao")
    from minimind.decode import quantize_weights_int8

    model = tiny_model(std=0.3).to(torch.bfloat16)
    before = {name: m.weight.detach().float().clone() for name, m in model.model.layers.named_modules()
              if isinstance(m, torch.nn.Linear)}
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantize_weights_int8(model)
    assert len(before) == 7 * model.config.num_hidden_layers
    for name, module in model.model.layers.named_modules():
        if name not in before:
            continue
        weight = module.weight
        assert weight.qdata.dtype == torch.int8 and weight.qdata.shape == before[name].shape
        scale = weight.scale.float().reshape(-1, 1)  # one per output row
        assert scale.shape[0] == before[name].shape[0]
        dequantized = weight.qdata.float() * scale
        # Round-to-nearest on a symmetric per-row grid: each weight within half a step of the original.
        assert (dequantized - before[name]).abs().le(scale / 2 + 1e-2 * scale).all()
        x = torch.randn(3, before[name].shape[1], dtype=torch.bfloat16)
        torch.testing.assert_close(module(x).float(), torch.nn.functional.linear(x.float(), dequantized),
                                   atol=0.05, rtol=0.02)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # embedding and tied head stay 16-bit
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_int8_weights_refuse_fp32_and_name_torchao_when_missing(monkeypatch):
    from minimind.decode import quantize_weights_int8

    with pytest.raises(ValueError, match=r"int8 weights pair with 16-bit activations, but the model holds "
                                         r"torch.float32: load it with dtype=torch.bfloat16 first"):
        quantize_weights_int8(tiny_model())
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization", None)
    with pytest.raises(ImportError, match=r"int8 weights use torchao, which is not installed .*"
                                          r"pip install 'minimind\[int8\]'"):
        quantize_weights_int8(tiny_model().to(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.kernels
def test_compiled_int8_decodes_as_the_eager_int8_model():
    pytest.importorskip("torchao")
    from minimind.decode import quantize_weights_int8

    model = quantize_weights_int8(tiny_model(std=0.3).to(torch.bfloat16))
    out = CompiledDecoder(model).generate(PROMPT, max_new_tokens=30, **greedy())
    plain = CompiledDecoder(model, compile=False).generate(PROMPT, max_new_tokens=30, **greedy())
    assert torch.equal(out[:, :PROMPT.shape[1] + 15], plain[:, :PROMPT.shape[1] + 15])
    assert greedy_gap(model, out, PROMPT.shape[1]) <= 0.0625
