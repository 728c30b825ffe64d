import json
import math
import re

import pytest

from configuration_minimind import MiniMindConfig


def test_defaults_match_upstream_minimind():
    c = MiniMindConfig()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (6400, 768, 8)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 4, 96)
    assert c.intermediate_size == math.ceil(768 * math.pi / 64) * 64 == 2432
    assert c.moe_intermediate_size == 2432
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)
    assert c.tie_word_embeddings is True and c.qk_norm is True
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert (c.num_experts, c.num_experts_per_tok) == (4, 1)
    # A dense config looks dense to libraries that inspect it (TRL's MoE aux-loss switch), like Qwen3's.
    assert not hasattr(c, "output_router_logits") and not hasattr(c, "router_aux_loss_coef")
    moe = MiniMindConfig(use_moe=True)
    assert (moe.router_aux_loss_coef, moe.output_router_logits) == (5e-4, False)
    assert c.mlp_only_layers == [] and c.decoder_sparse_step == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=64, num_attention_heads=4, head_dim=15), "head_dim"),
        (dict(hidden_size=66, num_attention_heads=4), "head_dim"),
        (dict(use_moe=True, num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(use_moe=True, num_experts=0), "num_experts"),
        (dict(use_moe=True, decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(rope_scaling={"rope_type": "ntk-by-parts", "factor": 2.0}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 0.5}), "rope_scaling"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(attention_dropout=1.5), "attention_dropout"),
        (dict(hidden_act="tanh-ish"), "hidden_act"),
        (dict(num_hidden_layers=2, mlp_only_layers=[5]), "mlp_only_layers"),
    ],
)
def test_invalid_config_names_field_and_fix(kwargs, field):
    with pytest.raises(ValueError, match=rf"^MiniMindConfig\.{field}: .+\. Fix: .+"):
        MiniMindConfig(**kwargs)


def test_rope_forms_are_normalised_to_one_dict():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 1024}
    legacy = MiniMindConfig(rope_theta=5e5, rope_scaling={"type": "yarn", **yarn})
    v4_style = MiniMindConfig(rope_theta=5e5, rope_scaling={"rope_type": "yarn", **yarn})
    v5_style = MiniMindConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, **yarn})
    expected = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 1024}
    assert legacy.rope_parameters == v4_style.rope_parameters == v5_style.rope_parameters == expected
    # YaRN without an explicit original length takes the configured context as the pre-scaling one.
    c = MiniMindConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 2})
    assert c.rope_parameters["original_max_position_embeddings"] == 4096


def test_inference_rope_is_upstream_yarn():
    """inference_rope_scaling is the upstream YaRN preset."""
    c = MiniMindConfig(inference_rope_scaling=True)
    assert c.rope_parameters["rope_type"] == "yarn"
    assert c.rope_parameters["factor"] == 16.0
    assert c.rope_parameters["original_max_position_embeddings"] == 2048
    assert c.rope_parameters["attention_factor"] == 1.0  # upstream leaves cos/sin unscaled


def test_flash_attn_sets_attn_implementation():
    """The flash_attn switch maps to attn_implementation."""
    assert MiniMindConfig(flash_attn=False)._attn_implementation == "eager"
    assert MiniMindConfig(flash_attn=False, attn_implementation="sdpa")._attn_implementation == "sdpa"


def test_save_and_reload_roundtrip(tmp_path):
    c = MiniMindConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_moe=True,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512},
    )
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "minimind"
    assert saved["auto_map"]["AutoConfig"] == "configuration_minimind.MiniMindConfig"
    assert not any(re.fullmatch(r"top_k|temperature", k) for k in saved)
    again = MiniMindConfig.from_pretrained(tmp_path)
    for key in (
        "hidden_size",
        "num_experts",
        "num_experts_per_tok",
        "mlp_only_layers",
        "rope_parameters",
        "intermediate_size",
        "head_dim",
        "use_moe",
    ):
        assert getattr(again, key) == getattr(c, key), key


def test_moe_layer_placement_like_qwen3():
    """MoE layer placement follows Qwen3-MoE rule."""
    c = MiniMindConfig(num_hidden_layers=6, use_moe=True, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not any(MiniMindConfig(num_hidden_layers=3).is_moe_layer(i) for i in range(3))


def test_fields_match_signature_and_save():
    """MiniMindConfig.FIELDS, derived from the signature, is the one field list; each field lands in config.json
    (the MoE-only ones for MoE configs) and reloads to the same value."""
    import inspect

    from configuration_minimind import MiniMindConfig

    signature = [
        name for name in inspect.signature(MiniMindConfig.__init__).parameters if name not in ("self", "kwargs")
    ]
    assert list(MiniMindConfig.FIELDS) == signature and "n_shared_experts" in signature
    config = MiniMindConfig(use_moe=True, n_shared_experts=1, hidden_size=64, num_attention_heads=4)
    saved = config.to_dict()
    missing = [f for f in MiniMindConfig.FIELDS if f not in saved and f not in ("rope_scaling",)]
    assert not missing
    again = MiniMindConfig.from_dict(saved)
    assert {f: getattr(again, f) for f in MiniMindConfig.FIELDS if f != "rope_scaling"} == {
        f: getattr(config, f) for f in MiniMindConfig.FIELDS if f != "rope_scaling"
    }
