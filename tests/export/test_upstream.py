"""Import of upstream MiniMind's transformers-format directories (config.json with upstream's field names,
model.safetensors with its parameter names), both of upstream's layouts, dense and MoE: the converted directory
gives the source model's logits exactly, and what cannot be imported is refused by name."""

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import TOKENIZER_DIR, TOKENIZER_FILES, current_config, tiny_model, upstream_dir
from minimind.cli import convert
from minimind.convert import convert_upstream_directory

# The tiny model as upstream would describe it; the MLP width is MiniMind2's rule for hidden 64:
# 64 * ceil(int(64 * 8 / 3) / 64) = 192, which MiniMind's pi rule (256) would not give.
TINY = dict(
    vocab_size=6400,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def minimind2_config(model, n_shared_experts=0):
    """config.json as MiniMind2's config writes it: intermediate_size null, no head_dim, n_routed_experts,
    aux_loss_alpha, scoring_func, seq_aux, n_shared_experts."""
    c = model.config
    return {
        "architectures": ["MiniMindForCausalLM"],
        "model_type": "minimind",
        "torch_dtype": "float32",
        "transformers_version": "4.48.0",
        "dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": None,
        "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "inference_rope_scaling": False,
        "flash_attn": True,
        "use_moe": c.use_moe,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_routed_experts": c.num_experts,
        "n_shared_experts": n_shared_experts,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.01,
        "seq_aux": True,
        "norm_topk_prob": True,
    }


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, 6400, (2, 12), generator=torch.Generator().manual_seed(0))


def upstream_moe_feed_forward(state, prefix, x, config, n_shared_experts):
    """Upstream MiniMind2's MOEFeedForward in eval mode, written from its source over the raw tensors: softmax
    router, top-k (renormalised when k > 1), routed experts weighted, then every shared expert added unweighted."""

    def mlp(name, h):
        w = {p: state[f"{prefix}{name}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
        return F.linear(F.silu(F.linear(h, w["gate_proj"])) * F.linear(h, w["up_proj"]), w["down_proj"])

    flat = x.reshape(-1, x.shape[-1])
    scores = F.linear(flat, state[f"{prefix}gate.weight"]).softmax(dim=-1)
    weight, index = torch.topk(scores, k=config.num_experts_per_tok, dim=-1, sorted=False)
    if config.num_experts_per_tok > 1:
        weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
    y = torch.zeros_like(flat)
    for token in range(flat.shape[0]):
        for slot in range(index.shape[1]):
            y[token] += weight[token, slot] * mlp(f"experts.{index[token, slot]}", flat[token])
    y = y.view(x.shape)
    for i in range(n_shared_experts):
        y = y + mlp(f"shared_experts.{i}", x)
    return y


@pytest.mark.parametrize(
    "layout, moe, shared",
    [
        ("current", False, 0),
        ("current", True, 0),
        ("minimind2", False, 0),
        ("minimind2", True, 0),
        ("minimind2", True, 2),
    ],
)
def test_directory_gives_identical_logits(tmp_path, layout, moe, shared):
    """Each layout, dense and MoE (top-2, experts narrower than the dense width), converts to a directory whose
    reload through AutoModelForCausalLM gives the source model's logits bit for bit."""
    moe_fields = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48) if moe else {}
    if layout == "current":
        source = tiny_model(std=0.3, intermediate_size=96, **TINY, **moe_fields)
        config = current_config(source)
    else:  # MiniMind2: no q/k norm, 8/3 MLP width, rms_norm_eps 1e-5; its experts are as wide as the dense MLP
        moe_fields = {**moe_fields, "moe_intermediate_size": 192} if moe else {}
        source = tiny_model(
            std=0.3,
            intermediate_size=192,
            qk_norm=False,
            rms_norm_eps=1e-5,
            n_shared_experts=shared,
            **TINY,
            **moe_fields,
        )
        config = minimind2_config(source, n_shared_experts=shared)
    upstream = upstream_dir(tmp_path / "upstream", source, config, head_name_only=layout == "minimind2")

    convert(["--from", "upstream-hf", "--model_name_or_path", str(upstream), "--output_dir", str(tmp_path / "out")])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert torch.equal(logits(loaded, IDS), logits(source, IDS))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["qk_norm"] is (layout == "current") and saved["use_moe"] is moe
    assert saved["intermediate_size"] == source.config.intermediate_size
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_minimind.MiniMindForCausalLM"  # ours, not upstream's
    if shared:  # the layer itself computes upstream's formula, shared experts included
        layer, x = loaded.model.layers[0].mlp, torch.randn(2, 5, source.config.hidden_size)
        state = {k.removeprefix("model.layers.0.mlp."): v for k, v in source.state_dict().items()}
        with torch.no_grad():
            ours, routed_only = layer(x), upstream_moe_feed_forward(state, "", x, source.config, 0)
            expected = upstream_moe_feed_forward(state, "", x, source.config, shared)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        assert (ours - routed_only).abs().max() > 0.1  # the shared experts' share is there, and large
        assert len(layer.shared_experts) == shared and saved["n_shared_experts"] == shared
    for name in TOKENIZER_FILES:  # upstream's tokenizer travels with its weights
        assert (tmp_path / "out" / name).read_bytes() == (upstream / name).read_bytes()


def test_top1_router_keeps_the_probability(tmp_path):
    """MiniMind2 renormalises the top-k weights only for k > 1: a top-1 expert's output is scaled by its router
    probability. The import turns norm_topk_prob off for such a checkpoint, and the converted MoE layer equals
    a per-token reference of that rule."""
    source = tiny_model(
        std=0.3,
        intermediate_size=192,
        qk_norm=False,
        use_moe=True,
        num_experts=4,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        **TINY,
    )
    upstream = upstream_dir(tmp_path / "upstream", source, minimind2_config(source))
    converted = convert_upstream_directory(upstream, tmp_path / "out")
    assert converted.config.norm_topk_prob is False
    mlp = converted.model.layers[0].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs = torch.softmax(x @ mlp.gate.weight.T, dim=-1)
        expected = torch.stack([probs[t].max() * mlp.experts[int(probs[t].argmax())](x[t]) for t in range(7)])
        torch.testing.assert_close(mlp(x[None])[0], expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(
            mlp(x[None])[0], torch.stack([mlp.experts[int(probs[t].argmax())](x[t]) for t in range(7)])
        )
    assert torch.equal(logits(converted, IDS), logits(source, IDS))


def test_half_precision_weights_stay_half(tmp_path):
    source = tiny_model(std=0.3, intermediate_size=96, **TINY)
    upstream = upstream_dir(tmp_path / "upstream", source, current_config(source), dtype=torch.bfloat16)
    convert_upstream_directory(upstream, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert loaded.dtype == torch.bfloat16
    # The reference takes the same loading path (from_pretrained keeps the RoPE frequencies in fp32, a cast
    # model would not), so any difference is the import's.
    source.to(torch.bfloat16).save_pretrained(tmp_path / "reference")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "reference", trust_remote_code=True).eval()
    assert torch.equal(logits(loaded, IDS), logits(reference, IDS))


def test_refusals_name_the_problem_and_the_fix(tmp_path):
    source = tiny_model(intermediate_size=192, qk_norm=False, use_moe=True, num_experts=4, **TINY)
    shared = upstream_dir(tmp_path / "shared", source, minimind2_config(source, n_shared_experts=1))
    with pytest.raises(ValueError, match=r"missing keys \(6\): \['model\.layers\.0\.mlp\.shared_experts\.0\."):
        convert_upstream_directory(shared, tmp_path / "out")  # a config promising shared experts the weights lack

    other = upstream_dir(tmp_path / "other", source, {**minimind2_config(source), "model_type": "qwen3"})
    with pytest.raises(ValueError, match="model_type is 'qwen3', not 'minimind'. Fix: pass an upstream MiniMind"):
        convert_upstream_directory(other, tmp_path / "out")

    dense = tiny_model(intermediate_size=96, **TINY)
    bare = upstream_dir(tmp_path / "bare", dense, current_config(dense), tokenizer=False)
    with pytest.raises(
        ValueError, match="only useful with the tokenizer it was trained with. Fix: pass --tokenizer_name_or_path"
    ):
        convert_upstream_directory(bare, tmp_path / "out")
    convert_upstream_directory(bare, tmp_path / "out", tokenizer_name_or_path=TOKENIZER_DIR)  # named: fine

    os.remove(bare / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors.*Fix: pass the directory"):
        convert_upstream_directory(bare, tmp_path / "out", tokenizer_name_or_path=TOKENIZER_DIR)

    wrong = upstream_dir(tmp_path / "wrong", dense, {**current_config(dense), "num_hidden_layers": 3})
    with pytest.raises(ValueError, match=r"missing keys \(11\).*model\.layers\.2\.input_layernorm\.weight"):
        convert_upstream_directory(wrong, tmp_path / "out")


def test_sharded_and_bin_weights_import_alike(tmp_path):
    """Upstream's weights as sharded safetensors (with their index) or as pytorch_model.bin give the same logits
    as model.safetensors."""
    source = tiny_model(std=0.3, intermediate_size=96, **TINY)
    sharded = tmp_path / "sharded"
    source.save_pretrained(sharded, max_shard_size="200KB")  # shards + model.safetensors.index.json
    assert not (sharded / "model.safetensors").exists() and len(list(sharded.glob("*.safetensors"))) > 1
    (sharded / "config.json").write_text(json.dumps(current_config(source)))
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(TOKENIZER_DIR, name), sharded)
    binary = upstream_dir(tmp_path / "binary", source, current_config(source))
    os.remove(binary / "model.safetensors")
    torch.save(source.state_dict(), binary / "pytorch_model.bin")
    for upstream in (sharded, binary):
        converted = convert_upstream_directory(upstream, tmp_path / f"out-{upstream.name}")
        assert torch.equal(logits(converted, IDS), logits(source, IDS))
