"""The model against references: the toy walkthrough numbers, cached vs full prefix, eager vs sdpa,
transformers' Qwen3 / Qwen3-MoE with the same weights, parameter counts, bad input."""

import inspect
import math

import pytest
import torch
from transformers import DynamicCache, StaticCache

from configuration_minimind import MiniMindConfig
from conftest import tiny_config, tiny_model
from minimind.export import to_qwen3_model
from modeling_minimind import (
    _CACHE_FIELD,
    MiniMindAttention,
    MiniMindDecoderLayer,
    MiniMindForCausalLM,
    MiniMindRotaryEmbedding,
    MiniMindSparseMoeBlock,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

# ------------------------------------------------------------------------------------------------------
# The toy walkthrough (d=2, one head) and the shape ledger
# ------------------------------------------------------------------------------------------------------


def _toy_attention():
    """d=2, one head, identity projections, no q/k norm, RoPE angle step pi/2."""
    config = MiniMindConfig(
        vocab_size=8,
        hidden_size=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        qk_norm=False,
        num_hidden_layers=1,
        intermediate_size=4,
        attn_implementation="eager",
    )
    attn = MiniMindAttention(config, layer_idx=0).eval()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        proj.weight.data = torch.eye(2)
    rotary = MiniMindRotaryEmbedding(config)
    rotary.inv_freq.fill_(math.pi / 2)
    return config, attn, rotary


def test_toy_walkthrough_numbers():
    config, attn, rotary = _toy_attention()
    X = torch.tensor([[[1.0, 1.0], [1.0, -1.0]]])  # [B=1, T=2, d=2], each row has RMS 1
    cos, sin = rotary(X, torch.arange(2)[None])
    q = k = X[:, None]  # identity projections, one head: [1, 1, 2, 2]
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_rot[0, 0], torch.tensor([[1.0, 1.0], [1.0, 1.0]]), atol=1e-6, rtol=0)

    causal = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]])[None, None]
    out, P = eager_attention_forward(attn, q_rot, k_rot, X[:, None], causal, scaling=2**-0.5)
    torch.testing.assert_close(P[0, 0], torch.tensor([[1.0, 0.0], [0.5, 0.5]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[0, :, 0], torch.tensor([[1.0, 1.0], [1.0, 0.0]]), atol=1e-6, rtol=0)

    # The same through the project's attention module, and the first residual Y = X + O.
    out, _ = attn(X, (cos, sin), attention_mask=causal)
    Y = X + out
    torch.testing.assert_close(Y[0], torch.tensor([[2.0, 2.0], [2.0, -1.0]]), atol=1e-6, rtol=0)


def test_shape_ledger(monkeypatch):
    """The README's shape table, read off the tensors a real forward produces (hooks and spies on the model's
    own calls), for a prefill and then a one-token cached decode step, with GQA (H=4 query, K=2 key/value heads)."""
    import modeling_minimind

    B, T, D, H, K, Dh, V = 2, 5, 64, 4, 2, 16, 97
    model = tiny_model(attn_implementation="eager")
    seen = []

    def record(stage):
        return lambda module, args, output: seen.append((stage, tuple(args[0].shape), tuple(output.shape)))

    layer = model.model.layers[0]
    hooks = [
        model.model.embed_tokens.register_forward_hook(record("embed")),
        layer.input_layernorm.register_forward_hook(record("norm")),
        layer.self_attn.q_norm.register_forward_hook(record("q_norm")),
        layer.self_attn.k_norm.register_forward_hook(record("k_norm")),
        layer.self_attn.o_proj.register_forward_hook(record("o_proj")),
        layer.mlp.register_forward_hook(record("mlp")),
        model.lm_head.register_forward_hook(record("lm_head")),
    ]
    # RoPE and the kernel are module-level functions shared by both layers: record them inside layer 0 only.
    in_layer0 = []
    hooks += [
        layer.self_attn.register_forward_pre_hook(lambda *_: in_layer0.append(True)),
        layer.self_attn.register_forward_hook(lambda *_: in_layer0.clear()),
    ]
    real_rope, real_interface = modeling_minimind.apply_rotary_pos_emb, modeling_minimind._attention_interface

    def rope_spy(q, k, cos, sin):
        q_rot, k_rot = real_rope(q, k, cos, sin)
        if in_layer0:
            seen.append(("rope", tuple(q.shape), tuple(k.shape), tuple(q_rot.shape), tuple(k_rot.shape)))
        return q_rot, k_rot

    def interface_spy(module):
        kernel = real_interface(module)

        def spy(module, q, k, v, mask, **kwargs):
            out, weights = kernel(module, q, k, v, mask, **kwargs)
            if in_layer0:
                seen.append(("kernel", tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(out.shape)))
            return out, weights

        return spy

    monkeypatch.setattr(modeling_minimind, "apply_rotary_pos_emb", rope_spy)
    monkeypatch.setattr(modeling_minimind, "_attention_interface", interface_spy)
    ids = torch.randint(0, V, (B, T))
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), _CACHE_FIELD)
        model(torch.randint(0, V, (B, 1)), cache=cache)
    for hook in hooks:
        hook.remove()

    def ledger(t, s):
        return [
            ("embed", (B, t), (B, t, D)),
            ("norm", (B, t, D), (B, t, D)),
            ("q_norm", (B, t, H, Dh), (B, t, H, Dh)),
            ("k_norm", (B, t, K, Dh), (B, t, K, Dh)),
            ("rope", (B, H, t, Dh), (B, K, t, Dh), (B, H, t, Dh), (B, K, t, Dh)),
            # the kernel gets k/v with the cache appended (S) and returns heads last-but-one
            ("kernel", (B, H, t, Dh), (B, K, s, Dh), (B, K, s, Dh), (B, t, H, Dh)),
            ("o_proj", (B, t, H * Dh), (B, t, D)),
            ("mlp", (B, t, D), (B, t, D)),
        ]

    head = ("lm_head", (B, T, D), (B, T, V))
    prefill, decode = seen[: seen.index(head) + 1], seen[seen.index(head) + 1 :]
    assert prefill == ledger(T, T) + [("lm_head", (B, T, D), (B, T, V))]
    assert decode == ledger(1, T + 1) + [("lm_head", (B, 1, D), (B, 1, V))]


@pytest.mark.parametrize("route", ["dense", "moe", "cached-decode"])
def test_block_keeps_shape_on_every_route(route):
    """Block preserves BTD on every route."""
    config = tiny_config(use_moe=route == "moe")
    layer = MiniMindDecoderLayer(config, 0).eval()
    rotary = MiniMindRotaryEmbedding(config)
    x = torch.randn(2, 5, config.hidden_size)
    if route == "cached-decode":
        cache = DynamicCache(config=config)
        layer(x, position_embeddings=rotary(x, torch.arange(5)[None]), cache=cache)
        step = torch.randn(2, 1, config.hidden_size)  # T_q = 1
        out = layer(step, position_embeddings=rotary(step, torch.tensor([[5]])), cache=cache)
        assert out.shape == step.shape and cache.get_seq_length() == 6
    else:
        out = layer(x, position_embeddings=rotary(x, torch.arange(5)[None]))
        assert out.shape == x.shape
        assert isinstance(layer.mlp, MiniMindSparseMoeBlock) == (route == "moe")


# ------------------------------------------------------------------------------------------------------
# Exact parameter counts
# ------------------------------------------------------------------------------------------------------


def test_minillama_parameter_count():
    """minillama_0_04b() has the expected parameter count."""
    model = MiniMindForCausalLM(MiniMindConfig.minillama_0_04b())
    assert sum(p.numel() for p in model.parameters()) == 35_926_528
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_head_adds_its_own_matrix():
    tied = tiny_model()
    untied = tiny_model(tie_word_embeddings=False)
    extra = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert extra == 97 * 64
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


# ------------------------------------------------------------------------------------------------------
# Cache: incremental decoding equals the full prefix
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_chunked_logits_equal_full_logits(cache_kind, attn):
    model = tiny_model(std=0.1, attn_implementation=attn)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = (
            DynamicCache(config=model.config)
            if cache_kind == "dynamic"
            else StaticCache(config=model.config, max_cache_len=16)
        )
        pieces, start = [], 0
        for size in (6, 2, 1):  # prefill, a chunk, one-token decode
            out = model(ids[:, start : start + size], cache=cache, use_cache=True)
            pieces.append(out.logits)
            start += size
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_past_key_values_is_the_same_cache():
    """The past_key_values keyword is the same cache."""
    model = tiny_model(std=0.1)
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        first = model(ids[:, :5], use_cache=True)
        cache = getattr(first, _CACHE_FIELD)  # `cache` in later 5.x, `past_key_values` in 5.17
        last = model(ids[:, 5:], past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(last, full, atol=1e-5, rtol=1e-5)


def test_greedy_cached_equals_uncached():
    """Greedy generate with and without cache is sensitive and equal."""
    model = tiny_model(std=0.2)
    prompt = torch.tensor([[5, 17, 42, 8, 3]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
        # Sensitivity: decoding the last token with no context must change the prediction, so a cache that
        # was silently dropped would show up as different tokens.
        with_ctx = model(cached[:, :-1]).logits[0, -1]
        no_ctx = model(cached[:, -2:-1]).logits[0, -1]
    assert torch.equal(cached, uncached)
    assert (with_ctx - no_ctx).abs().max() > 0.5
    assert len(set(cached[0, 5:].tolist())) > 1


def test_left_padded_row_equals_unpadded_row():
    model = tiny_model(std=0.2)
    short = torch.tensor([[7, 3, 9]])
    long = torch.tensor([[4, 12, 30, 2, 50, 6]])
    batch = torch.tensor([[0, 0, 0, 7, 3, 9], [4, 12, 30, 2, 50, 6]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        alone_short = model.generate(short, max_new_tokens=8, do_sample=False)
        alone_long = model.generate(long, max_new_tokens=8, do_sample=False)
    assert torch.equal(together[0, 6:], alone_short[0, 3:])
    assert torch.equal(together[1, 6:], alone_long[0, 6:])


def test_sampling_and_beams_equal_qwen3():
    """Sampling and beam search equal Qwen3 with same weights and seed."""
    ours = tiny_model(std=0.2, attn_implementation="eager")
    theirs = to_qwen3_model(ours)
    prompt = torch.tensor([[5, 17, 42], [9, 3, 61]])
    sample = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, pad_token_id=0)
    beam = dict(
        max_new_tokens=8,
        num_beams=3,
        do_sample=False,
        num_return_sequences=2,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    outputs = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        torch.manual_seed(1234)
        sampled = model.generate(prompt, **sample)
        torch.manual_seed(4321)  # a second seed: the same draw twice would not show that the seed matters
        resampled = model.generate(prompt, **sample)
        outputs[name] = sampled, resampled, model.generate(prompt, **beam)
    (sampled, resampled, beams), (ref_sampled, ref_resampled, ref_beams) = outputs["ours"], outputs["theirs"]
    assert torch.equal(sampled, ref_sampled) and torch.equal(resampled, ref_resampled)
    assert not torch.equal(sampled, resampled)  # sampling really samples at this temperature
    assert beams.sequences.shape == (4, 11)
    assert torch.equal(beams.sequences, ref_beams.sequences)
    torch.testing.assert_close(beams.sequences_scores, ref_beams.sequences_scores, atol=1e-5, rtol=1e-5)
    greedy = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert not torch.equal(sampled, greedy)


def test_streamer_gets_prompt_then_each_token():
    """Streamer receives the prompt then each generated token."""

    class Recorder:  # the streamer protocol: put(prompt), put(token) per step, end()
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.chunks.append(None)

    model = tiny_model(std=0.2)
    prompt = torch.tensor([[5, 17, 42]])
    recorder = Recorder()
    streamed = model.generate(prompt, max_new_tokens=4, do_sample=False, streamer=recorder)
    assert torch.equal(recorder.chunks[0].view(-1), prompt[0]) and recorder.chunks[-1] is None
    assert len(recorder.chunks) == 1 + 4 + 1
    assert torch.equal(torch.cat([c.view(-1) for c in recorder.chunks[1:-1]]), streamed[0, 3:])


# ------------------------------------------------------------------------------------------------------
# eager vs sdpa
# ------------------------------------------------------------------------------------------------------


def _pair(**overrides):
    eager = tiny_model(std=0.1, attn_implementation="eager", **overrides)
    sdpa = tiny_model(std=0.1, attn_implementation="sdpa", **overrides)
    sdpa.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    return eager, sdpa


def test_eager_equals_sdpa_with_padding():
    """Eager equals SDPA without and with padding mask."""
    eager, sdpa = _pair()
    ids = torch.randint(1, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on row 0
    with torch.no_grad():
        torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)
        a, b = eager(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0, 3:], b[0, 3:], atol=1e-5, rtol=1e-5)  # non-padded rows only
    torch.testing.assert_close(a[1], b[1], atol=1e-5, rtol=1e-5)


def test_eager_equals_sdpa_with_cache():
    """Eager equals SDPA with non empty cache and mask."""
    eager, sdpa = _pair()
    ids = torch.randint(1, 97, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    results = []
    with torch.no_grad():
        for model in (eager, sdpa):
            cache = DynamicCache(config=model.config)
            model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
            results.append(model(ids[:, 6:], attention_mask=mask, cache=cache, use_cache=True).logits)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_set_attn_implementation_switches_kernel(monkeypatch):
    import modeling_minimind

    calls = {"eager": 0, "sdpa": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        modeling_minimind, "eager_attention_forward", counting("eager", modeling_minimind.eager_attention_forward)
    )
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        counting("sdpa", torch.nn.functional.scaled_dot_product_attention),
    )
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3]])
    model.set_attn_implementation("eager")
    out = model(ids, output_attentions=True)
    assert calls == {"eager": 2, "sdpa": 0}  # one call per layer
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 3, 3)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, out.logits, atol=1e-5, rtol=1e-5)
    assert calls == {"eager": 2, "sdpa": 2}


def test_flash_attention_2_missing_is_clear():
    """flash_attention_2 without the package is a clear error."""
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash_attn is installed: the error path cannot be exercised here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="FlashAttention2"):
        MiniMindForCausalLM(tiny_config(attn_implementation="flash_attention_2"))


# ------------------------------------------------------------------------------------------------------
# Parity with transformers' Qwen3 / Qwen3-MoE
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["default", "yarn", "linear"],
)
@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_qwen3_with_same_weights(rope, tied):
    ours = tiny_model(std=0.1, rope_scaling=rope, tie_word_embeddings=tied, attn_implementation="eager")
    theirs = to_qwen3_model(ours)  # transformers' own class, our state dict loaded with strict=True
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)
    if rope:
        assert ours.model.rotary_emb.attention_scaling == pytest.approx(theirs.model.rotary_emb.attention_scaling)
        assert theirs.config.rope_parameters["rope_type"] == rope["rope_type"]
        # The scaling must change the numbers, or a config that silently fell back to plain RoPE would pass.
        unscaled = tiny_model(std=0.1, tie_word_embeddings=tied, attn_implementation="eager")
        unscaled.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (ours(ids).logits - unscaled(ids).logits).abs().max() > 1e-3


ROPE_TYPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.0,
        "truncate": False,
    },
    {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 10 for i in range(8)],
        "long_factor": [2.0 + i / 10 for i in range(8)],
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


@pytest.mark.parametrize("rope", ROPE_TYPES, ids=lambda r: r["rope_type"])
def test_every_rope_type_equals_qwen3(rope):
    """inv_freq, attention scaling and cos/sin equal Qwen3's for every rope type transformers accepts for it,
    at positions inside and beyond max_position_embeddings (where dynamic and longrope switch frequencies)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = tiny_config(max_position_embeddings=128, rope_parameters=dict(rope))
    reference = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters=dict(config.rope_parameters),
    )
    ours, theirs = MiniMindRotaryEmbedding(config), Qwen3RotaryEmbedding(reference)
    torch.testing.assert_close(ours.inv_freq, theirs.inv_freq, atol=0, rtol=1e-6)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling, rel=1e-12)
    x = torch.zeros(1)
    for length in (16, 300):  # inside, then 2.3x past the trained length
        positions = torch.arange(length)[None]
        for a, b in zip(ours(x, positions), theirs(x, positions)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_logits_and_aux_loss_equal_qwen3_moe(top_k):
    ours = tiny_model(
        std=0.1,
        use_moe=True,
        num_experts=4,
        num_experts_per_tok=top_k,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        attn_implementation="eager",
    )
    theirs = to_qwen3_model(ours)  # per-expert weights fused into Qwen3-MoE's tensors, strict load
    theirs.set_attn_implementation("eager")  # fully padded query rows differ between kernels, and the loss sees them
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=ids)
        b = theirs(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    torch.testing.assert_close(a.logits[1], b.logits[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.logits[0, 4:], b.logits[0, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.aux_loss, b.aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Mixture of experts
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_bf16_autocast_bitwise_qwen3(top_k):
    # The weighted expert outputs add up in the residual stream's dtype (fp32 under autocast), as Qwen3-MoE's
    # eager experts do; summing them in bf16 instead moves the output by about 1e-2.
    """Moe block under bf16 autocast equals qwen3 moe bit for bit."""
    ours = tiny_model(std=0.1, use_moe=True, num_experts=4, num_experts_per_tok=top_k)
    theirs = to_qwen3_model(ours)
    theirs.set_experts_implementation("eager")  # the same per-expert matmuls as ours; grouped_mm rounds otherwise
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours.model.layers[0].mlp(x)
        expected = theirs.model.layers[0].mlp(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_moe_block_equals_plain_per_token_routing():
    config = tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    moe = MiniMindSparseMoeBlock(config)
    x = torch.randn(2, 5, config.hidden_size)
    out = moe(x)
    logits, _, _ = moe.gate(x.view(-1, config.hidden_size))
    reference = torch.zeros_like(x.view(-1, config.hidden_size))
    probs = logits.softmax(-1)
    for t, token in enumerate(x.view(-1, config.hidden_size)):
        w, e = probs[t].topk(2)
        w = w / w.sum()
        reference[t] = sum(w[j] * moe.experts[e[j]](token) for j in range(2))
    torch.testing.assert_close(out.view(-1, config.hidden_size), reference, atol=1e-6, rtol=1e-5)


def test_moe_aux_loss_only_with_labels(monkeypatch):
    """MoE aux loss in loss with labels and absent at generation."""
    import modeling_minimind

    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2)
    ids = torch.randint(0, 97, (2, 6))
    out = model(ids, labels=ids)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    lm_only = model.loss_function(logits=out.logits, labels=ids, vocab_size=97)
    torch.testing.assert_close(out.loss, lm_only + 5e-4 * out.aux_loss)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (12, 4)

    calls = []
    original = modeling_minimind.load_balancing_loss_func
    spy = lambda *a, **k: calls.append(1) or original(*a, **k)  # noqa: E731
    monkeypatch.setattr(modeling_minimind, "load_balancing_loss_func", spy)
    plain = model(ids)
    assert plain.aux_loss is None and plain.router_logits is None and not calls
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 9) and not calls


@pytest.mark.parametrize("top_k", [1, 2])
def test_router_gradient_equals_hand_computed(top_k):
    """d(g . out)/d(router weight) for fixed upstream gradients g. Each token's output is
    sum_i w_i * expert_i(x) with w = p_top / sum(p_top) (k=2) or p / stopgrad(p) (k=1), p = softmax(W x);
    so dL/dlogit_j = sum_i c_i * dw_i/dlogit_j with c_i = g . expert_i(x), and dw/dlogit follows from
    dp_i/dlogit_j = p_i (delta_ij - p_j). With k=1 this is c * (delta_ej - p_j): not zero, so the LM loss
    trains the router even though every weight is exactly 1."""
    config = tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=top_k)
    torch.manual_seed(0)
    moe = MiniMindSparseMoeBlock(config).double()
    x = torch.randn(1, 5, config.hidden_size, dtype=torch.float64)
    upstream = torch.randn_like(x)
    (moe(x) * upstream).sum().backward()

    tokens, router = x.view(-1, config.hidden_size), moe.gate.weight.detach()
    expected = torch.zeros_like(router)
    for token, g in zip(tokens, upstream.view(-1, config.hidden_size)):
        p = torch.softmax(router @ token, dim=-1)
        top = p.topk(top_k).indices
        c = torch.stack([g @ moe.experts[e](token).detach() for e in top])  # [k]
        dp = torch.diag(p) - p[:, None] * p[None, :]  # dp_i/dlogit_j, [E, E]
        if top_k == 1:
            dw = dp[top] / p[top, None]  # d(p / stopgrad(p))
        else:
            s = p[top].sum()
            dw = dp[top] / s - p[top, None] * dp[top].sum(0, keepdim=True) / s**2
        expected += torch.outer(c @ dw, token)
    # The router softmax runs in fp32 (as Qwen3-MoE's), hence fp32 tolerances on a float64 block.
    torch.testing.assert_close(moe.gate.weight.grad, expected, atol=1e-6, rtol=1e-5)
    assert expected.abs().max() > 1e-3


def test_moe_left_padded_generate_matches():
    """MoE generate with left padding matches unpadded."""
    model = tiny_model(std=0.2, use_moe=True, num_experts=4, num_experts_per_tok=2)
    batch = torch.tensor([[0, 0, 9, 4, 7], [3, 5, 8, 1, 2]])
    mask = (batch != 0).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    alone = model.generate(batch[:1, 2:], max_new_tokens=5, do_sample=False)
    assert torch.equal(together[0, 5:], alone[0, 3:])


# ------------------------------------------------------------------------------------------------------
# Forward contract
# ------------------------------------------------------------------------------------------------------


def test_embeds_hidden_states_and_logits_to_keep():
    """inputs_embeds, output_hidden_states, return_dict and logits_to_keep."""
    model = tiny_model(std=0.1)
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        base = model(ids, output_hidden_states=True)
        from_embeds = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
        last_two = model(ids, logits_to_keep=2).logits
        as_tuple = model(ids, return_dict=False, use_cache=False)
    torch.testing.assert_close(from_embeds, base.logits)
    assert len(base.hidden_states) == 3 and base.hidden_states[0].shape == (2, 6, 64)
    torch.testing.assert_close(last_two, base.logits[:, -2:])
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], base.logits)


def test_logits_to_keep_scores_kept_window():
    """Logits to keep with labels scores the kept window."""
    model = tiny_model(std=0.1)
    ids = torch.randint(0, 97, (2, 8))
    full = model(ids)
    kept = model(ids, labels=ids, logits_to_keep=3)
    expected = model.loss_function(logits=full.logits[:, -3:].contiguous(), labels=ids[:, -3:], vocab_size=97)
    torch.testing.assert_close(kept.loss, expected)


def test_shifted_label_loss_ignores_minus_100():
    model = tiny_model(std=0.1)
    ids = torch.randint(0, 97, (1, 6))
    labels = ids.clone()
    labels[0, :3] = -100
    logits = model(ids).logits
    manual = torch.nn.functional.cross_entropy(logits[0, 2:-1], ids[0, 3:])
    torch.testing.assert_close(model(ids, labels=labels).loss, manual)


def test_resize_token_embeddings_keeps_the_tie():
    model = tiny_model()
    model.resize_token_embeddings(120)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (120, 64) and model.config.vocab_size == 120


def test_bf16_autocast_training_stays_finite():
    model = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 97, (2, 16))
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_gradient_checkpointing_same_gradients():
    """Gradient checkpointing gives the same gradients."""
    model = tiny_model(std=0.1).train()
    ids = torch.randint(0, 97, (2, 8))
    model(ids, labels=ids).loss.backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(ids, labels=ids, use_cache=True).loss.backward()
    for a, b in zip(plain, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------


def test_token_ids_outside_vocabulary_raise():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"token id\(s\) \[97, 500\] outside the vocabulary \[0, 97\)"):
        model(torch.tensor([[1, 97, 500]]))
    with pytest.raises(ValueError, match=r"token id\(s\) \[-3\]"):
        model(torch.tensor([[-3, 2]]))


@pytest.mark.parametrize("mask_shape", [(2, 5), (1, 6), (2, 1, 5, 6), (2, 6, 1)])
def test_attention_mask_of_the_wrong_shape_raises(mask_shape):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"attention_mask has shape .* Fix: pass one mask column"):
        model(torch.randint(0, 97, (2, 6)), attention_mask=torch.ones(mask_shape, dtype=torch.long))


def test_beyond_max_positions_warns_once(caplog):
    """A sequence beyond max_position_embeddings runs like Qwen3 and warns once."""
    import transformers

    model = tiny_model(std=0.1, max_position_embeddings=16, attn_implementation="eager")
    theirs = to_qwen3_model(model)
    ids = torch.randint(0, 97, (1, 40))
    logger = transformers.utils.logging.get_logger("modeling_minimind")
    logger.warning_once.cache_clear()
    transformers.utils.logging.enable_propagation()
    with caplog.at_level("WARNING"), torch.no_grad():
        ours = model(ids).logits
        model(ids)
        cache = DynamicCache(config=model.config)
        model(ids[:, :16], cache=cache, use_cache=True)
        stepped = model(ids[:, 16:17], cache=cache, use_cache=True).logits
    torch.testing.assert_close(ours, theirs(ids).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped[0, -1], ours[0, 16], atol=1e-5, rtol=1e-5)
    warnings = [r for r in caplog.records if "longer than max_position_embeddings=16" in r.getMessage()]
    assert len(warnings) == 1


def test_continuous_batching_equals_generate():
    """Continuous batching with paged cache equals generate."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model(std=0.2)
    prompts = [[5, 17, 42, 8], [7, 3, 9], [1, 2, 3, 4, 5, 6]]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A small paged cache: sized from free memory by default, which on a CPU box means gigabytes to set up.
    # Earlier 5.x releases (5.17) call the page size `block_size`.
    size_name = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    paging = ContinuousBatchingConfig(**{size_name: 16}, num_blocks=8, max_batch_tokens=64)
    results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=paging)
    by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    for prompt in prompts:
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert by_prompt[tuple(prompt)] == alone.tolist()
