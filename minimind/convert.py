"""Import an upstream MiniMind `.pth` checkpoint (a plain torch state dict) into a MiniMind HF directory.

Upstream's parameter names are MiniMind's, so the import is: build the config from the upstream settings,
check the key sets match exactly (every difference reported by name), load strictly, `save_pretrained`.
Upstream keeps its RoPE tables as `freqs_cos` / `freqs_sin` buffers; MiniMind recomputes RoPE, so those are
dropped by name.
"""

import json
from pathlib import Path

import torch

# Upstream config names that MiniMind (like Qwen3-MoE) spells differently.
_UPSTREAM_RENAMES = {"n_routed_experts": "num_experts", "aux_loss_alpha": "router_aux_loss_coef"}
_ROPE_TABLE_BUFFERS = ("freqs_cos", "freqs_sin")
# Wrappers that prefix every key when a model is saved from torch.compile or DistributedDataParallel.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def config_from_upstream_settings(settings):
    """A MiniMindConfig from upstream MiniMind's settings (its config names or ours); refuses what MiniMind
    does not implement instead of silently dropping it."""
    from configuration_minimind import MiniMindConfig

    settings = {_UPSTREAM_RENAMES.get(key, key): value for key, value in settings.items()}
    if settings.pop("n_shared_experts", 0) and settings.get("use_moe"):
        raise ValueError("n_shared_experts > 0: MiniMind has no shared experts, so their weights would be lost. "
                         "Fix: import a checkpoint trained with n_shared_experts=0.")
    scoring = settings.pop("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"scoring_func={scoring!r}: MiniMind routes with softmax only.")
    for training_only in ("dropout", "seq_aux"):  # upstream training switches, no effect on the weights' outputs
        settings.pop(training_only, None)
    return MiniMindConfig(**settings)


def load_upstream_state_dict(path):
    """The checkpoint's tensors (weights_only load: no code from the file runs), wrapper prefixes removed and
    RoPE tables dropped."""
    state_dict = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"{path} is not a plain state dict (name -> tensor) as upstream MiniMind saves it.")
    cleaned = {}
    for key, value in state_dict.items():
        for prefix in _WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        if key.rsplit(".", 1)[-1] not in _ROPE_TABLE_BUFFERS:
            cleaned[key] = value
    return cleaned


def check_state_dict_matches(state_dict, model):
    """Raise one ValueError naming every missing, unexpected and wrongly shaped tensor."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings and "lm_head.weight" not in state_dict:
        expected = {key: value for key, value in expected.items() if key != "lm_head.weight"}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = [f"{key}: checkpoint {list(state_dict[key].shape)} vs config {list(expected[key].shape)}"
                  for key in sorted(set(expected) & set(state_dict)) if state_dict[key].shape != expected[key].shape]
    if missing or unexpected or mismatched:
        raise ValueError(
            "The checkpoint does not match the MiniMind config built from the given settings.\n"
            f"missing keys ({len(missing)}): {missing}\nunexpected keys ({len(unexpected)}): {unexpected}\n"
            f"shape mismatches ({len(mismatched)}): {mismatched}\n"
            "Fix: pass the settings the checkpoint was trained with (e.g. --hidden_size, --num_hidden_layers, "
            "--num_key_value_heads, --intermediate_size, --use_moe, --qk_norm/--no_qk_norm).")
    if model.config.tie_word_embeddings and "lm_head.weight" in state_dict and \
            not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings=True but the checkpoint's lm_head.weight differs from "
                         "model.embed_tokens.weight. Fix: pass --no_tie_word_embeddings.")


def convert_upstream_checkpoint(pth_path, config, output_dir, tokenizer_name_or_path=None):
    """Write a MiniMind HF directory (safetensors in the checkpoint's dtype, config with auto_map, code
    files, generation config, tokenizer if given) from an upstream `.pth`; return the loaded model."""
    from modeling_minimind import MiniMindForCausalLM

    from minimind.export import copy_tokenizer_files

    state_dict = load_upstream_state_dict(pth_path)
    model = MiniMindForCausalLM(config)
    check_state_dict_matches(state_dict, model)
    # Checked above; a tied head absent from the file is filled by the tie itself.
    model.load_state_dict(state_dict, strict="lm_head.weight" in state_dict)
    dtypes = {value.dtype for value in state_dict.values() if value.is_floating_point()}
    if len(dtypes) == 1:  # upstream saves half precision: keep it, no silent upcast to fp32 files
        model = model.to(dtypes.pop())
    model.eval().save_pretrained(output_dir)
    if tokenizer_name_or_path:
        if not copy_tokenizer_files(tokenizer_name_or_path, output_dir):
            raise ValueError(f"No tokenizer files in {tokenizer_name_or_path}.")
    return model


def read_settings_json(path):
    """Upstream settings from a JSON file: a config dict, e.g. upstream's `MiniMindConfig(...).to_dict()`."""
    settings = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(settings, dict):
        raise ValueError(f"{path} must hold a JSON object of config settings.")
    for transformers_bookkeeping in ("architectures", "auto_map", "model_type", "transformers_version", "dtype",
                                     "torch_dtype"):
        settings.pop(transformers_bookkeeping, None)
    return settings
