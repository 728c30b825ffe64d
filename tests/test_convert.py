"""Import of upstream MiniMind `.pth` state dicts: strict names, RoPE tables ignored, mismatches named."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import TOKENIZER_DIR, load_script, tiny_model

# Flags describing tiny_config() as upstream settings.
TINY_FLAGS = ["--vocab_size", "97", "--hidden_size", "64", "--intermediate_size", "96", "--num_hidden_layers", "2",
              "--num_attention_heads", "4", "--num_key_value_heads", "2", "--max_position_embeddings", "256",
              "--rope_theta", "10000"]


def _convert(*args):
    return load_script("convert_minimind").main([str(a) for a in args])


def _upstream_pth(path, model, dtype=None):
    """Save `model` the way upstream MiniMind does: a plain state dict, with its RoPE tables as buffers."""
    state_dict = {key: value.to(dtype) if dtype else value for key, value in model.state_dict().items()}
    state_dict["model.freqs_cos"] = torch.randn(256, 16)
    state_dict["model.freqs_sin"] = torch.randn(256, 16)
    torch.save(state_dict, path)
    return path


def test_import_fp16_checkpoint_with_flags_loads_with_remote_code(tmp_path):
    source = tiny_model(std=0.1, qk_norm=False)  # upstream's older models have no q/k norm
    pth = _upstream_pth(tmp_path / "full_sft_64.pth", source, dtype=torch.float16)
    _convert("--pth", pth, "--output_dir", tmp_path / "hf", "--no_qk_norm", *TINY_FLAGS,
             "--tokenizer_name_or_path", TOKENIZER_DIR)

    files = set(os.listdir(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "generation_config.json", "configuration_minimind.py",
            "modeling_minimind.py"} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16  # no silent upcast
        assert not any("freqs" in key for key in f.keys())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["qk_norm"] is False and config["auto_map"]["AutoModelForCausalLM"]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32)
    reference = tiny_model(qk_norm=False)
    reference.load_state_dict({k: v.half().float() for k, v in source.state_dict().items()})
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_import_moe_from_upstream_settings_json(tmp_path):
    source = tiny_model(use_moe=True, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    pth = _upstream_pth(tmp_path / "moe.pth", source)
    settings = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "rope_theta": 10000.0, "use_moe": True, "n_routed_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 0, "scoring_func": "softmax", "aux_loss_alpha": 0.01, "seq_aux": True,
                "dropout": 0.0, "tie_word_embeddings": False, "model_type": "minimind"}
    (tmp_path / "upstream.json").write_text(json.dumps(settings))
    model = _convert("--model_name_or_path", pth, "--config_json", tmp_path / "upstream.json", "--output_dir", tmp_path / "hf")

    assert (model.config.num_experts, model.config.router_aux_loss_coef) == (4, 0.01)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_mismatched_checkpoint_names_missing_unexpected_and_shapes(tmp_path):
    state_dict = tiny_model().state_dict()
    state_dict["model.layers.0.mlp.shared_experts.0.up_proj.weight"] = torch.zeros(3, 3)
    torch.save(state_dict, tmp_path / "bad.pth")
    flags = list(TINY_FLAGS)
    flags[flags.index("--num_hidden_layers") + 1] = "3"
    flags[flags.index("--intermediate_size") + 1] = "128"
    with pytest.raises(ValueError) as error:
        _convert("--pth", tmp_path / "bad.pth", "--output_dir", tmp_path / "hf", *flags)
    message = str(error.value)
    assert "missing keys" in message and "model.layers.2.self_attn.q_proj.weight" in message
    assert "unexpected keys (1): ['model.layers.0.mlp.shared_experts.0.up_proj.weight']" in message
    assert "model.layers.0.mlp.gate_proj.weight: checkpoint [96, 64] vs config [128, 64]" in message
    assert not (tmp_path / "hf").exists()


def test_upstream_features_minimind_lacks_are_refused():
    from minimind.convert import config_from_upstream_settings

    with pytest.raises(ValueError, match="shared experts"):
        config_from_upstream_settings({"use_moe": True, "n_shared_experts": 1})
    with pytest.raises(ValueError, match="scoring_func"):
        config_from_upstream_settings({"scoring_func": "sigmoid"})


def test_tied_checkpoint_without_lm_head_and_top_level_rope_tables_imports_exactly(tmp_path):
    """Upstream may save a tied model without `lm_head.weight`, with its RoPE tables at the top level and under
    a `torch.compile` / DDP wrapper prefix; all of it imports to the same logits."""
    source = tiny_model(std=0.1)
    state_dict = {f"_orig_mod.module.{key}": value for key, value in source.state_dict().items()
                  if key != "lm_head.weight"}
    state_dict.update(freqs_cos=torch.randn(256, 16), freqs_sin=torch.randn(256, 16))
    torch.save(state_dict, tmp_path / "tied.pth")
    model = _convert("--pth", tmp_path / "tied.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, source(ids).logits, atol=0, rtol=0)


def test_tied_config_with_a_different_lm_head_is_refused_naming_the_fix(tmp_path):
    state_dict = dict(tiny_model().state_dict())
    state_dict["lm_head.weight"] = state_dict["lm_head.weight"] + 1
    torch.save(state_dict, tmp_path / "untied.pth")
    with pytest.raises(ValueError) as error:
        _convert("--pth", tmp_path / "untied.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    assert str(error.value) == ("tie_word_embeddings=True but the checkpoint's lm_head.weight differs from "
                                "model.embed_tokens.weight. Fix: pass --no_tie_word_embeddings.")
    assert not (tmp_path / "hf").exists()


def test_files_that_are_not_a_state_dict_or_settings_object_are_refused(tmp_path):
    from minimind.convert import load_upstream_state_dict, read_settings_json

    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    torch.save({"weight": torch.zeros(1), "step": 3}, tmp_path / "mixed.pth")
    for name in ("list.pth", "mixed.pth"):
        with pytest.raises(ValueError) as error:
            load_upstream_state_dict(tmp_path / name)
        assert str(error.value) == (f"{tmp_path / name} is not a plain state dict (name -> tensor) as upstream "
                                    "MiniMind saves it.")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as error:
        read_settings_json(tmp_path / "list.json")
    assert str(error.value) == f"{tmp_path / 'list.json'} must hold a JSON object of config settings."
    # transformers' own bookkeeping in a saved config.json is not a setting
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "architectures": ["X"], "auto_map": {},
                                                      "model_type": "minimind", "transformers_version": "5",
                                                      "dtype": "float32", "torch_dtype": "float32"}))
    assert read_settings_json(tmp_path / "config.json") == {"hidden_size": 64}
