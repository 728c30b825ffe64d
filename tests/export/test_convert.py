"""Import of upstream MiniMind `.pth` state dicts: strict names, RoPE tables ignored, mismatches named."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import TOKENIZER_DIR, load_script, tiny_model

# Flags describing tiny_config() as upstream settings.
TINY_FLAGS = [
    "--vocab_size",
    "97",
    "--hidden_size",
    "64",
    "--intermediate_size",
    "96",
    "--num_hidden_layers",
    "2",
    "--num_attention_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--max_position_embeddings",
    "256",
    "--rope_theta",
    "10000",
]


def _convert(*args):
    return load_script("convert_minimind").main([str(a) for a in args])


def _upstream_pth(path, model, dtype=None):
    """Save `model` the way upstream MiniMind does: a plain state dict, with its RoPE tables as buffers."""
    state_dict = {key: value.to(dtype) if dtype else value for key, value in model.state_dict().items()}
    state_dict["model.freqs_cos"] = torch.randn(256, 16)
    state_dict["model.freqs_sin"] = torch.randn(256, 16)
    torch.save(state_dict, path)
    return path


def test_fp16_checkpoint_with_flags_loads(tmp_path):
    """Import fp16 checkpoint with flags loads with remote code."""
    source = tiny_model(std=0.1, qk_norm=False)  # upstream's older models have no q/k norm
    pth = _upstream_pth(tmp_path / "full_sft_64.pth", source, dtype=torch.float16)
    _convert(
        "--pth",
        pth,
        "--output_dir",
        tmp_path / "hf",
        "--no_qk_norm",
        *TINY_FLAGS,
        "--tokenizer_name_or_path",
        TOKENIZER_DIR,
    )

    files = set(os.listdir(tmp_path / "hf"))
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "configuration_minimind.py",
        "modeling_minimind.py",
    } <= files
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
    settings = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "use_moe": True,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 0,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.01,
        "seq_aux": True,
        "dropout": 0.0,
        "tie_word_embeddings": False,
        "model_type": "minimind",
    }
    (tmp_path / "upstream.json").write_text(json.dumps(settings))
    model = _convert(
        "--model_name_or_path", pth, "--config_json", tmp_path / "upstream.json", "--output_dir", tmp_path / "hf"
    )

    assert (model.config.num_experts, model.config.router_aux_loss_coef) == (4, 0.01)
    for key, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_mismatched_checkpoint_names_keys(tmp_path):
    """Mismatched checkpoint names missing unexpected and shapes."""
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


def test_unsupported_upstream_features_refused():
    """Upstream features MiniMind lacks are refused and shared experts kept."""
    from minimind.convert import config_from_upstream_settings

    assert config_from_upstream_settings({"use_moe": True, "n_shared_experts": 2}).n_shared_experts == 2
    with pytest.raises(ValueError, match="scoring_func"):
        config_from_upstream_settings({"scoring_func": "sigmoid"})


def test_tied_checkpoint_imports_exactly(tmp_path):
    """Upstream may save a tied model without `lm_head.weight`, with its RoPE tables at the top level and under
    a `torch.compile` / DDP wrapper prefix; all of it imports to the same logits."""
    source = tiny_model(std=0.1)
    state_dict = {
        f"_orig_mod.module.{key}": value for key, value in source.state_dict().items() if key != "lm_head.weight"
    }
    state_dict.update(freqs_cos=torch.randn(256, 16), freqs_sin=torch.randn(256, 16))
    torch.save(state_dict, tmp_path / "tied.pth")
    model = _convert("--pth", tmp_path / "tied.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, source(ids).logits, atol=0, rtol=0)


def test_tied_config_with_own_head_refused(tmp_path):
    """A tied config with a different lm_head is refused, naming the fix."""
    state_dict = dict(tiny_model().state_dict())
    state_dict["lm_head.weight"] = state_dict["lm_head.weight"] + 1
    torch.save(state_dict, tmp_path / "untied.pth")
    with pytest.raises(ValueError) as error:
        _convert("--pth", tmp_path / "untied.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    assert str(error.value) == (
        "tie_word_embeddings=True but the checkpoint's lm_head.weight differs from "
        "model.embed_tokens.weight. Fix: pass --no_tie_word_embeddings."
    )
    assert not (tmp_path / "hf").exists()


def test_non_state_dict_files_are_refused(tmp_path):
    """Files that are not a state dict or settings object are refused."""
    from minimind.convert import load_upstream_state_dict, read_settings_json

    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    torch.save({"weight": torch.zeros(1), "step": 3}, tmp_path / "mixed.pth")
    for name in ("list.pth", "mixed.pth"):
        with pytest.raises(ValueError) as error:
            load_upstream_state_dict(tmp_path / name)
        assert str(error.value) == (
            f"{tmp_path / name} is not a plain state dict (name -> tensor) as upstream MiniMind saves it."
        )
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as error:
        read_settings_json(tmp_path / "list.json")
    assert str(error.value) == f"{tmp_path / 'list.json'} must hold a JSON object of config settings."
    # transformers' own bookkeeping in a saved config.json is not a setting
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "architectures": ["X"],
                "auto_map": {},
                "model_type": "minimind",
                "transformers_version": "5",
                "dtype": "float32",
                "torch_dtype": "float32",
            }
        )
    )
    assert read_settings_json(tmp_path / "config.json") == {"hidden_size": 64}


def _convert_error(capsys, *args):
    """The command's exit code 2 and its one line on stderr (no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        _convert(*args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


def _damage(path, how):
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * (len(data) // 256), "empty": b""}[how]
    )


PTH_DAMAGE = {
    "truncated": "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory",
    "garbage": "UnpicklingError: Unsupported operand 0",
    "empty": "EOFError: the file is empty",
}


@pytest.mark.parametrize("how", PTH_DAMAGE)
def test_a_damaged_pth_is_named_in_one_line(tmp_path, capsys, how):
    pth = _upstream_pth(tmp_path / "full_sft_64.pth", tiny_model())
    _damage(pth, how)
    error = _convert_error(capsys, "--pth", pth, "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    assert error == (
        f"error: {pth} is not a readable PyTorch checkpoint (truncated or not a torch.save file): {PTH_DAMAGE[how]}"
    )
    assert not (tmp_path / "hf").exists()


def test_missing_or_pickled_pth_is_one_line(tmp_path, capsys):
    """A missing .pth or a pickled module is named in one line."""
    error = _convert_error(capsys, "--pth", tmp_path / "nope.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    assert error == (
        f"error: {tmp_path / 'nope.pth'}: no such file. Fix: check the path of the upstream checkpoint (--pth)."
    )
    torch.save(tiny_model(), tmp_path / "module.pth")  # a whole pickled model, not a state dict
    error = _convert_error(capsys, "--pth", tmp_path / "module.pth", "--output_dir", tmp_path / "hf", *TINY_FLAGS)
    assert error.startswith(
        f"error: {tmp_path / 'module.pth'} holds Python objects besides tensors, which a "
        "weights-only load refuses so that no code from the file runs (UnpicklingError: "
        "Unsupported global: GLOBAL modeling_minimind.MiniMindForCausalLM was not an allowed"
    )
    assert error.endswith("Fix: save the state dict alone: torch.save(model.state_dict(), path).")
    assert not (tmp_path / "hf").exists()


def _upstream_hf_dir(path):
    from safetensors.torch import save_file

    model = tiny_model()
    path.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        str(path / "model.safetensors"),
    )
    (path / "config.json").write_text(json.dumps({**model.config.to_dict(), "model_type": "minimind"}))
    return path


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_damaged_safetensors_is_one_line(tmp_path, capsys, how):
    """Damaged upstream safetensors are named in one line."""
    upstream = _upstream_hf_dir(tmp_path / "upstream")
    weights = upstream / "model.safetensors"
    size = weights.stat().st_size
    _convert(
        "--from",
        "upstream-hf",
        "--pth",
        upstream,
        "--output_dir",
        tmp_path / "good",
        "--tokenizer_name_or_path",
        TOKENIZER_DIR,
    )  # the directory imports before the damage
    _damage(weights, how)
    error = _convert_error(
        capsys,
        "--from",
        "upstream-hf",
        "--pth",
        upstream,
        "--output_dir",
        tmp_path / "hf",
        "--tokenizer_name_or_path",
        TOKENIZER_DIR,
    )
    problem = {
        "truncated": f"{size // 2} bytes where its header promises {size}",
        "garbage": f"{weights.stat().st_size} bytes, shorter than its own header",
    }[how]
    assert error == (
        f"error: {weights} is not a readable safetensors file (truncated or damaged): {problem}. "
        "Fix: copy or download it again."
    )
    assert not (tmp_path / "hf").exists()


def test_missing_dir_or_bad_config_is_one_line(tmp_path, capsys):
    """A missing upstream directory or damaged config is named in one line."""
    fix = (
        "Fix: with --from upstream-hf pass the directory that upstream's save_pretrained wrote (for a .pth file "
        "leave --from out)."
    )
    error = _convert_error(
        capsys, "--from", "upstream-hf", "--pth", tmp_path / "nope", "--output_dir", tmp_path / "hf"
    )
    assert error == f"error: {tmp_path / 'nope'}: no such directory. {fix}"
    upstream = _upstream_hf_dir(tmp_path / "upstream")
    (upstream / "config.json").write_text('{"model_type": "minimind", ')
    error = _convert_error(
        capsys,
        "--from",
        "upstream-hf",
        "--pth",
        upstream,
        "--output_dir",
        tmp_path / "hf",
        "--tokenizer_name_or_path",
        TOKENIZER_DIR,
    )
    assert error == (
        f"error: {upstream / 'config.json'} is not readable JSON (JSONDecodeError: Expecting property "
        "name enclosed in double quotes: line 1 column 28 (char 27)). Fix: pass the upstream directory's "
        "config.json as upstream wrote it."
    )
    assert not (tmp_path / "hf").exists()
