"""Open a MiniMind model directory with the installed classes: how every MiniMind command loads a model.

`trust_remote_code=True` is for users' own scripts; our commands never need it and never run code shipped in a
model directory. A directory is checked before any weights are read: it exists (or names a Hub repository,
where the command allows one), its config.json is MiniMind's, and the tensors its weights files hold are the
ones that config builds, name for name and shape for shape. Every refusal is an `InputError` naming the path and
the fix, so a command prints one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from configuration_minimind import MiniMindConfig
from minimind.errors import InputError

MODEL_TYPE = MiniMindConfig.model_type
# The files a MiniMind directory needs from the Hub: configs, weights, tokenizer, chat template; never code.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.md"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class NotMiniMindError(InputError):
    """A model directory of another architecture."""


def model_directory(name_or_path: str | Path, *, hub: bool = True) -> Path:
    """The local directory of `name_or_path`: a directory as given, or (with `hub`) the snapshot of a Hub
    repository id, model files only. Anything else is an `InputError` saying what is there instead."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise InputError(
            f"{text} is a file, not a model directory: pass the directory that holds config.json and the weights"
        )
    # A first component that is a local directory (runs/sft with runs/ present) means a local path, mistyped.
    if not hub or not _REPO_ID.match(text) or Path(text.split("/")[0]).is_dir():
        raise InputError(f"no such directory: {text}")
    return _hub_snapshot(text)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=offline))
    except Exception as error:  # network, missing repository, gated, not cached: all end the command alike
        reason = (
            "the Hub is offline (HF_HUB_OFFLINE=1) and it is not in the local cache"
            if offline
            else f"the Hub could not provide it as a repository id ({type(error).__name__})"
        )
        raise InputError(f"no such directory: {repo_id}; {reason}") from None


def read_config_json(directory: Path) -> dict:
    """config.json of `directory` as JSON. Not through transformers' reader: that one would follow an `auto_map` of
    another model type into code shipped beside it."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise InputError(f"{directory} is not a model directory: it has no config.json")
    try:
        settings = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise InputError(
            f"{config_file} is not valid JSON ({type(error).__name__}): the checkpoint is damaged; "
            "restore config.json from the run that wrote it"
        ) from None
    if not isinstance(settings, dict):
        raise InputError(
            f"{config_file} holds a JSON {type(settings).__name__}, not an object: the checkpoint is "
            "damaged; restore config.json from the run that wrote it"
        )
    return settings


def _not_minimind(directory: Path, settings: dict, also: str = "") -> NotMiniMindError:
    code = " and names code of its own (auto_map), which MiniMind commands never run" if "auto_map" in settings else ""
    return NotMiniMindError(
        f"{directory} is not a MiniMind checkpoint: its config.json says model_type {settings.get('model_type')!r}, "
        f"not {MODEL_TYPE!r}{also}{code}. Fix: pass a directory written by MiniMind, or import other checkpoints "
        "with minimind-convert"
    )


def read_minimind_config(directory: Path) -> MiniMindConfig:
    """The directory's config, refused unless it is a MiniMind config."""
    settings = read_config_json(directory)
    if settings.get("model_type") != MODEL_TYPE:
        raise _not_minimind(directory, settings)
    try:
        return MiniMindConfig.from_pretrained(directory)
    except (TypeError, ValueError) as error:
        raise InputError(f"{directory / 'config.json'}: {error}") from None


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    from modeling_minimind import safetensors_problem

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InputError(
            f"{directory} holds no weights (*.safetensors): copy the weights saved with its config.json "
            "(a .pth file from the reference project imports with minimind-convert)"
        )
    shapes = {}
    for path in files:
        if problem := safetensors_problem(path):
            raise InputError(
                f"{path} ({problem}): the safetensors file is incomplete or damaged. Fix: copy or "
                "download it again; a checkpoint killed mid-save is not loadable, take an earlier one."
            )
        with safe_open(str(path), framework="pt") as weights:
            shapes.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})
    return shapes


def _tied_copy_differs(directory: Path, tied: dict[str, str]) -> list[str]:
    """Tied names whose tensor is stored anyway and differs from the tensor it is tied to."""
    from safetensors import safe_open

    stored = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            stored.update({name: path for name in weights.keys()})

    def tensor(name):
        with safe_open(str(stored[name]), framework="pt") as weights:
            return weights.get_tensor(name)

    return [
        name
        for name, source in tied.items()
        if name in stored and source in stored and not torch.equal(tensor(name), tensor(source))
    ]


def listed(names) -> str:
    """Tensor names for a one-line message: the first six, sorted, and how many more."""
    names = sorted(names)
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def shape_mismatches(model, directory: Path, optional=()) -> list[str]:
    """What stops the weights in `directory` from filling `model` (a meta-device instance): missing (`optional`
    ones aside), unexpected and mis-shaped tensors, one entry per kind; read from the headers, no tensor data."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    found = _weight_shapes(directory)
    problems = []
    if missing := [name for name in expected if name not in found and name not in optional]:
        problems.append(f"missing {listed(missing)}")
    if unexpected := [name for name in found if name not in expected]:
        problems.append(f"unexpected {listed(unexpected)}")
    if misshaped := [
        f"{name} (weights {list(found[name])}, config {list(shape)})"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]:
        problems.append(f"mis-shaped {listed(misshaped)}")
    return problems


def weight_mismatches(directory: Path, config: MiniMindConfig) -> list[str]:
    """What stops the weights in `directory` from filling the model `config` builds, one entry per kind
    (missing, unexpected, mis-shaped, an untied copy of a tied tensor); empty when they match."""
    from modeling_minimind import MiniMindForCausalLM

    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {}) if config.tie_word_embeddings else {}
    if config.tie_word_embeddings and not tied:  # transformers 4.x names only the tied side
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    problems = shape_mismatches(model, directory, optional=tied)
    if not problems and (untied := _tied_copy_differs(directory, tied)):
        problems.append(
            f"config.json ties {listed(untied)} to the embeddings but the weights hold a different "
            "tensor (tie_word_embeddings should be false)"
        )
    return problems


def check_model_directory(name_or_path: str | Path, *, hub: bool = True) -> tuple[Path, MiniMindConfig]:
    """(directory, config) of a MiniMind checkpoint whose config.json matches its weights; an InputError otherwise.
    Reads no tensor data."""
    directory = model_directory(name_or_path, hub=hub)
    config = read_minimind_config(directory)
    if problems := weight_mismatches(directory, config):
        raise InputError(
            f"{directory}: config.json does not match the weights ({'; '.join(problems)}). Fix: "
            "restore the config.json saved with these weights; a model loaded this way would be "
            "partly random"
        )
    return directory, config


def load_model(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, hub: bool = True):
    """A `MiniMindForCausalLM` (eval mode, on the CPU) from a checked MiniMind directory or Hub id."""
    from modeling_minimind import MiniMindForCausalLM

    directory, config = check_model_directory(name_or_path, hub=hub)
    return MiniMindForCausalLM.from_pretrained(directory, config=config, dtype=dtype).eval()


def load_native_causal_lm(name_or_path: str | Path, *, dtype: torch.dtype = torch.float32):
    """A MiniMind model as `load_model` gives it, or a causal LM of an architecture transformers itself ships;
    code shipped in the directory is never run."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    directory = model_directory(name_or_path)
    settings = read_config_json(directory)
    if settings.get("model_type") == MODEL_TYPE:
        return load_model(directory, dtype=dtype)
    if settings.get("model_type") not in CONFIG_MAPPING:
        raise _not_minimind(directory, settings, also=" nor one transformers ships")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=False).eval()


def load_tokenizer(name_or_path: str | Path, *, hub: bool = True):
    """The tokenizer of a MiniMind directory (or Hub id), loaded without running code from it."""
    from minimind.tokenizer import load_tokenizer as load_checked_tokenizer

    return load_checked_tokenizer(model_directory(name_or_path, hub=hub))
