"""Import upstream MiniMind checkpoints into MiniMind HF directories: a `.pth` (a plain torch state dict), or a
transformers-format directory that upstream publishes (config.json with `model_type: "minimind"` and upstream's
field names, model.safetensors with upstream's parameter names).

Upstream's parameter names are MiniMind's, so the import is: build the config from the upstream settings,
check the key sets match exactly (every difference reported by name), load strictly, `save_pretrained`.
Upstream keeps its RoPE tables as `freqs_cos` / `freqs_sin` buffers; MiniMind recomputes RoPE, so those are
dropped by name.

A directory's config.json does not always say everything the weights need, and upstream has two layouts:
- MiniMind2 (2025): no q/k norm, `intermediate_size` may be null (its model then derived 8/3 x hidden rounded up
  to 64, where MiniMind derives pi x hidden), experts named `n_routed_experts`, and its router renormalises
  the top-k weights only when k > 1 (MiniMind's `norm_topk_prob` renormalises a top-1 weight to 1 as well);
- the current layout: q/k norm, MiniMind's own field names (`num_experts`, `moe_intermediate_size`, ...).
So q/k norm and the MLP widths are read off the tensors themselves, and the routing rule off the field names.
"""

import json
from pathlib import Path

import torch

from minimind.errors import InputError

# Upstream config names that MiniMind (like Qwen3-MoE) spells differently.
_UPSTREAM_RENAMES = {"n_routed_experts": "num_experts", "aux_loss_alpha": "router_aux_loss_coef"}
_ROPE_TABLE_BUFFERS = ("freqs_cos", "freqs_sin")
# Wrappers that prefix every key when a model is saved from torch.compile or DistributedDataParallel.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class MissingInputError(InputError, FileNotFoundError):
    """A path the import needs does not exist: one line from the command, and a FileNotFoundError to callers."""


def _short_reason(error):
    """The first sentence of what a loader said: torch wraps a weights-only refusal in paragraphs of advice."""
    text = str(error).split("WeightsUnpickler error:")[-1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), "").split(". ")[0].rstrip(".")
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def read_torch_file(path):
    """torch.load(path) weights-only (no code from the file runs); each way that fails is an InputError that names
    the file and what is wrong with it."""
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"{path}: no such file. Fix: check the path of the upstream checkpoint (--pth).")
    if path.is_dir():
        raise InputError(
            f"{path} is a directory, not a .pth file. Fix: pass the .pth file, or --from upstream-hf "
            "for a directory that upstream's save_pretrained wrote."
        )
    try:
        if path.stat().st_size == 0:
            raise EOFError("the file is empty")
        return torch.load(path, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as error:
        if "Unsupported global" in str(error):
            raise InputError(
                f"{path} holds Python objects besides tensors, which a weights-only load refuses so "
                f"that no code from the file runs ({_short_reason(error)}). Fix: save the state dict "
                "alone: torch.save(model.state_dict(), path)."
            ) from None
        raise InputError(
            f"{path} is not a readable PyTorch checkpoint (truncated or not a torch.save file): {_short_reason(error)}"
        ) from None


def read_safetensors_file(path):
    """safetensors' load_file(path); a missing, truncated or damaged file is an InputError naming it."""
    from safetensors.torch import load_file

    from modeling_minimind import safetensors_problem

    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"{path}: no such file. Fix: copy the complete upstream directory again.")
    try:
        problem = safetensors_problem(path)  # header and length only: names a truncation by its sizes
        if problem is None:
            return load_file(str(path))
    except MemoryError:
        raise
    except Exception as error:
        problem = _short_reason(error)
    raise InputError(
        f"{path} is not a readable safetensors file (truncated or damaged): {problem}. Fix: copy or download it again."
    )


def _read_json(path, what):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingInputError(f"{path}: no such file. Fix: check the path of {what}.") from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise InputError(
            f"{path} is not readable JSON ({_short_reason(error)}). Fix: pass {what} as upstream wrote it."
        ) from None


def config_from_upstream_settings(settings):
    """A MiniMindConfig from upstream MiniMind's settings (its config names or ours); refuses what MiniMind
    does not implement instead of silently dropping it."""
    from configuration_minimind import MiniMindConfig

    settings = {_UPSTREAM_RENAMES.get(key, key): value for key, value in settings.items()}
    if not settings.get("use_moe"):
        settings.pop("n_shared_experts", None)  # upstream writes it into dense configs too
    scoring = settings.pop("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"scoring_func={scoring!r}: MiniMind routes with softmax only.")
    for training_only in ("dropout", "seq_aux"):  # upstream training switches, no effect on the weights' outputs
        settings.pop(training_only, None)
    return MiniMindConfig(**settings)


def load_upstream_state_dict(path):
    """The checkpoint's tensors (weights_only load: no code from the file runs), wrapper prefixes removed and
    RoPE tables dropped."""
    state_dict = read_torch_file(path)
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise InputError(f"{path} is not a plain state dict (name -> tensor) as upstream MiniMind saves it.")
    return _strip_wrappers_and_rope_tables(state_dict)


def _strip_wrappers_and_rope_tables(state_dict):
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
    mismatched = [
        f"{key}: checkpoint {list(state_dict[key].shape)} vs config {list(expected[key].shape)}"
        for key in sorted(set(expected) & set(state_dict))
        if state_dict[key].shape != expected[key].shape
    ]
    if missing or unexpected or mismatched:
        raise ValueError(
            "The checkpoint does not match the MiniMind config built from the given settings.\n"
            f"missing keys ({len(missing)}): {missing}\nunexpected keys ({len(unexpected)}): {unexpected}\n"
            f"shape mismatches ({len(mismatched)}): {mismatched}\n"
            "Fix: pass the settings the checkpoint was trained with (e.g. --hidden_size, --num_hidden_layers, "
            "--num_key_value_heads, --intermediate_size, --use_moe, --qk_norm/--no_qk_norm)."
        )
    if (
        model.config.tie_word_embeddings
        and "lm_head.weight" in state_dict
        and not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"])
    ):
        raise ValueError(
            "tie_word_embeddings=True but the checkpoint's lm_head.weight differs from "
            "model.embed_tokens.weight. Fix: pass --no_tie_word_embeddings."
        )


def convert_upstream_checkpoint(pth_path, config, output_dir, tokenizer_name_or_path=None):
    """Write a MiniMind HF directory (safetensors in the checkpoint's dtype, config with auto_map, code
    files, generation config, tokenizer if given) from an upstream `.pth`; return the loaded model."""
    return _write_minimind_dir(load_upstream_state_dict(pth_path), config, output_dir, tokenizer_name_or_path)


def _write_minimind_dir(state_dict, config, output_dir, tokenizer_name_or_path=None):
    from minimind.export import copy_tokenizer_files
    from modeling_minimind import MiniMindForCausalLM

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
    settings = _read_json(path, "a JSON object of config settings (--config_json)")
    if not isinstance(settings, dict):
        raise InputError(f"{path} must hold a JSON object of config settings.")
    for transformers_bookkeeping in (
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
    ):
        settings.pop(transformers_bookkeeping, None)
    return settings


# --------------------------------------------------------------------------------------------------------------
# Upstream transformers-format directories
# --------------------------------------------------------------------------------------------------------------

# Fields only MiniMind2's config has; their presence marks that layout.
_MINIMIND2_FIELDS = ("n_routed_experts", "n_shared_experts", "scoring_func", "aux_loss_alpha", "seq_aux")
_FIRST_LAYER = "model.layers.0."


def load_upstream_directory_weights(upstream_dir):
    """The tensors of an upstream directory: model.safetensors, its shards (model.safetensors.index.json), or
    pytorch_model.bin (loaded weights_only), with wrapper prefixes and RoPE tables removed as for a `.pth`."""
    upstream_dir = Path(upstream_dir)
    index = upstream_dir / "model.safetensors.index.json"
    if (upstream_dir / "model.safetensors").is_file():
        state_dict = read_safetensors_file(upstream_dir / "model.safetensors")
    elif index.is_file():
        weight_map = _read_json(index, "the sharded weights' index")
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise InputError(f"{index} has no 'weight_map' object. Fix: copy the complete upstream directory again.")
        state_dict = {}
        for shard in sorted(set(map(str, weight_map["weight_map"].values()))):
            state_dict.update(read_safetensors_file(upstream_dir / shard))
    elif (upstream_dir / "pytorch_model.bin").is_file():
        return load_upstream_state_dict(upstream_dir / "pytorch_model.bin")
    else:
        raise MissingInputError(
            f"{upstream_dir} has no model.safetensors, model.safetensors.index.json or "
            f"pytorch_model.bin. Fix: pass the directory upstream's save_pretrained wrote "
            f"(for a .pth file use --pth)."
        )
    return _strip_wrappers_and_rope_tables(state_dict)


def settings_from_upstream_directory(config_json, state_dict):
    """MiniMind settings for an upstream directory: its config.json, plus what only the tensors tell (q/k norm,
    MLP widths, an untied head) and MiniMind2's top-1 routing rule. Raises ValueError for a directory that is
    not upstream MiniMind's."""
    settings = _read_json(config_json, "the upstream directory's config.json")
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    if model_type != "minimind":
        raise ValueError(
            f"{config_json}: model_type is {model_type!r}, not 'minimind'. Fix: pass "
            f"an upstream MiniMind directory (a MiniMind directory of this project needs no import)."
        )
    minimind2 = any(name in settings for name in _MINIMIND2_FIELDS)
    for bookkeeping in ("architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype"):
        settings.pop(bookkeeping, None)
    if settings.get("inference_rope_scaling") and settings.get("rope_scaling"):
        settings.pop("rope_scaling")  # upstream's YaRN preset, which inference_rope_scaling=True rebuilds
    settings["qk_norm"] = f"{_FIRST_LAYER}self_attn.q_norm.weight" in state_dict
    dense_width = state_dict.get(f"{_FIRST_LAYER}mlp.gate_proj.weight")
    expert_width = state_dict.get(f"{_FIRST_LAYER}mlp.experts.0.gate_proj.weight")
    if dense_width is not None:
        settings["intermediate_size"] = dense_width.shape[0]
    if expert_width is not None:
        settings["moe_intermediate_size"] = expert_width.shape[0]
        if settings.get("intermediate_size") is None:
            settings["intermediate_size"] = expert_width.shape[0]
    if (
        "tie_word_embeddings" not in settings
        and "lm_head.weight" in state_dict
        and "model.embed_tokens.weight" in state_dict
        and not torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"])
    ):
        settings["tie_word_embeddings"] = False
    if minimind2 and settings.get("use_moe") and settings.get("num_experts_per_tok", 2) == 1:
        # MiniMind2 leaves a lone top-1 weight as the router probability; norm_topk_prob would make it 1.
        settings["norm_topk_prob"] = False
    return settings


def convert_upstream_directory(upstream_dir, output_dir, tokenizer_name_or_path=None, overrides=None):
    """Write a MiniMind HF directory from an upstream transformers-format directory; return the loaded model.
    The tokenizer comes from the upstream directory unless another is named: the weights mean nothing with a
    tokenizer they were not trained with."""
    from minimind.export import TOKENIZER_FILES

    upstream_dir = Path(upstream_dir)
    if not upstream_dir.is_dir():
        fix = (
            "Fix: with --from upstream-hf pass the directory that upstream's save_pretrained wrote (for a .pth "
            "file leave --from out)."
        )
        if upstream_dir.exists():
            raise InputError(f"{upstream_dir} is a file, not a directory. {fix}")
        raise MissingInputError(f"{upstream_dir}: no such directory. {fix}")
    if not (upstream_dir / "config.json").is_file():
        raise MissingInputError(
            f"{upstream_dir} has no config.json. Fix: pass the directory upstream's "
            f"save_pretrained wrote (for a .pth file use --pth)."
        )
    if not tokenizer_name_or_path and not (upstream_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"{upstream_dir} has no tokenizer.json, and a checkpoint is only useful with the tokenizer "
            f"it was trained with. Fix: pass --tokenizer_name_or_path with upstream's tokenizer "
            f"directory (one holding {', '.join(TOKENIZER_FILES[:2])})."
        )
    state_dict = load_upstream_directory_weights(upstream_dir)
    settings = settings_from_upstream_directory(upstream_dir / "config.json", state_dict)
    settings.update(overrides or {})
    config = config_from_upstream_settings(settings)
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in state_dict and "lm_head.weight" in state_dict:
        # A tied pair saved under the head's name alone (transformers keeps one name of a shared tensor).
        state_dict["model.embed_tokens.weight"] = state_dict.pop("lm_head.weight")
    return _write_minimind_dir(state_dict, config, output_dir, tokenizer_name_or_path or upstream_dir)
