"""What a resume needs: every file a resume would load from a checkpoint-N checked (present, complete, readable)
without loading the model, the newest complete checkpoint found, and --resume_from_checkpoint resolved."""

from __future__ import annotations

import json
import logging
import zipfile
from pathlib import Path

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from minimind.errors import InputError
from modeling_minimind import safetensors_problem

logger = logging.getLogger(__package__)  # the package's one logger, `minimind.training`

RESUME_LATEST = ("last", "latest", "true", "auto")

OPTIMIZER_FILE, SCHEDULER_FILE, SCALER_FILE = "optimizer.pt", "scheduler.pt", "scaler.pt"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")  # full model, or a PEFT (LoRA) adapter
SHARDED_WEIGHTS_INDEX = "model.safetensors.index.json"


def _safetensors_problem(path):
    """None if `path` is a complete safetensors file: its header read, the file exactly as long as the header's
    data offsets say, so a truncated or padded file is caught without reading tensors."""
    if not path.is_file():
        return f"{path.name} is missing"
    problem = safetensors_problem(path)
    return f"{path.name} is damaged ({problem})" if problem else None


def _torch_file_problem(path, load=False):
    """None if `path` is a complete torch.save file. torch.save writes a zip archive whose central directory is at
    the very end, so a truncated file is no readable archive; checked without unpickling or loading tensors. With
    load=True (the small scheduler, scaler and RNG files) it is also loaded as Trainer loads it (weights_only, with
    Trainer's numpy allowlist for the RNG state), so damage inside a whole archive is caught here too, not as a
    pickle traceback after the model is built."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        return f"{path.name} is damaged (not a complete torch.save file: {error})"
    if load:
        from transformers.trainer_pt_utils import safe_globals

        try:
            with safe_globals():
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - whatever the unpickler raises, the file cannot be resumed from
            # The weights_only unpickler wraps its reason in paragraphs about trusting the file; keep the reason.
            text = str(error).split("WeightsUnpickler error:")[-1]
            reason = next((line.strip() for line in text.splitlines() if line.strip()), "")
            return f"{path.name} is damaged (torch.load fails: {type(error).__name__}: {reason})"
    return None


# JSON files that Trainer (config.json) or PEFT (adapter_config.json) read on resume when they are present.
CONFIG_FILES = ("config.json", "adapter_config.json")


def _json_object_problem(path):
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        return f"{path.name} is damaged ({error})"
    return None if isinstance(value, dict) else f"{path.name} is damaged (not a JSON object)"


def _weights_problems(path):
    for name in WEIGHT_FILES:
        if (path / name).exists():
            return [problem for problem in [_safetensors_problem(path / name)] if problem]
    index = path / SHARDED_WEIGHTS_INDEX
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return [f"{SHARDED_WEIGHTS_INDEX} is damaged ({error!r})"]
        return [problem for shard in shards if (problem := _safetensors_problem(path / shard))]
    if any(child.name.startswith("pytorch_model_fsdp") for child in path.iterdir()):
        return []  # FSDP's sharded state, loaded (and checked) by accelerate
    return [f"{WEIGHT_FILES[0]} is missing (no model weights)"]


def _trainer_state_problem(path):
    state_file = path / TRAINER_STATE_NAME
    if not state_file.is_file():
        return f"{TRAINER_STATE_NAME} is missing"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{TRAINER_STATE_NAME} is damaged ({error})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{TRAINER_STATE_NAME} is damaged (no integer global_step)"
    return None


def checkpoint_problems(path, training_args=None, scaler=False):
    """What a resume with `training_args` would need from checkpoint `path` and is missing or damaged: [] when
    the checkpoint is complete.

    Trainer loads the weights and trainer_state.json always; unless --save_only_model also optimizer.pt and
    scheduler.pt (it silently starts a fresh optimizer if either is missing), the RNG state of every process
    (rng_state.pth, or rng_state_<rank>.pth per process of a multi-process run; missing ones only log at info
    level), and scaler.pt when the run uses a gradient scaler (fp16). Under DeepSpeed the weights, optimizer and
    scheduler are DeepSpeed's own files, which DeepSpeed checks. config.json (adapter_config.json for LoRA) is read
    when present, so it must then be a JSON object. Without `training_args`: a full single- or multi-process
    checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return ["it is not a directory"]
    problems = [problem for problem in [_trainer_state_problem(path)] if problem]
    problems += [
        problem for name in CONFIG_FILES if (path / name).exists() and (problem := _json_object_problem(path / name))
    ]
    deepspeed = bool(getattr(training_args, "deepspeed", None))
    if not deepspeed:
        problems += _weights_problems(path)
    if getattr(training_args, "save_only_model", False):
        return problems
    if not deepspeed:
        # Trainer also takes an optimizer saved as optimizer.bin or in a sharded optimizer_* directory (FSDP).
        other_optimizer = (path / "optimizer.bin").is_file() or any(
            child.is_dir() and "optimizer" in child.name for child in path.iterdir()
        )
        if (path / OPTIMIZER_FILE).exists() or not other_optimizer:
            problems.append(_torch_file_problem(path / OPTIMIZER_FILE))
        problems.append(_torch_file_problem(path / SCHEDULER_FILE, load=True))
    if training_args is None:
        rng_files = sorted(path.glob("rng_state*.pth")) or [path / "rng_state.pth"]
    elif training_args.world_size > 1:
        rng_files = [path / f"rng_state_{rank}.pth" for rank in range(training_args.world_size)]
    else:
        rng_files = [path / "rng_state.pth"]
    problems += [_torch_file_problem(rng_file, load=True) for rng_file in rng_files]
    if scaler and not deepspeed:
        problems.append(_torch_file_problem(path / SCALER_FILE, load=True))
    return [problem for problem in problems if problem]


def is_complete_checkpoint(path, training_args=None, scaler=False):
    """Whether checkpoint `path` holds everything a resume with `training_args` loads, each file readable."""
    return not checkpoint_problems(path, training_args, scaler)


def checkpoint_dirs(output_dir):
    """{step: path} of the checkpoint-N directories in output_dir."""
    steps = {}
    if Path(output_dir).is_dir():
        for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            step = path.name.rsplit("-", 1)[1]
            if path.is_dir() and step.isdigit():
                steps[int(step)] = path
    return steps


def latest_complete_checkpoint(output_dir, training_args=None, scaler=False):
    """Newest complete checkpoint-N in output_dir, or None. Newer incomplete ones are skipped with a warning that
    names each missing or damaged file."""
    steps = checkpoint_dirs(output_dir)
    for step in sorted(steps, reverse=True):
        problems = checkpoint_problems(steps[step], training_args, scaler)
        if not problems:
            return str(steps[step])
        logger.warning(
            "not resuming from %s: %s; falling back to an older checkpoint", steps[step], "; ".join(problems)
        )
    return None


def resolve_resume_checkpoint(training_args, scaler=False):
    """--resume_from_checkpoint PATH, or 'last' (also true/auto/latest): the newest complete checkpoint in
    --output_dir (see `checkpoint_problems`); starts fresh with a warning when there is no checkpoint yet, so the
    same command can be rerun. Raises InputError for an incomplete PATH, and for 'last' when checkpoints exist
    but none is complete: neither may silently lose the state they hold."""
    value = training_args.resume_from_checkpoint
    if not value:
        return None
    if value.lower() in RESUME_LATEST:
        checkpoint = latest_complete_checkpoint(training_args.output_dir, training_args, scaler)
        if checkpoint is None:
            damaged = [str(path) for _, path in sorted(checkpoint_dirs(training_args.output_dir).items())]
            if damaged:
                raise InputError(
                    f"--resume_from_checkpoint {value}: no checkpoint in {training_args.output_dir} is complete "
                    f"({', '.join(damaged)}; the warnings above name the missing or damaged files). Fix: restore "
                    "those files, or move the checkpoint directories away to start from scratch."
                )
            logger.warning("no checkpoint in %s yet; starting from scratch", training_args.output_dir)
        return checkpoint
    problems = checkpoint_problems(value, training_args, scaler)
    if problems:
        raise InputError(
            f"--resume_from_checkpoint {value}: not a complete checkpoint: {'; '.join(problems)}. "
            "Fix: restore the file(s), or pass --resume_from_checkpoint last to take the newest "
            "complete checkpoint."
        )
    return value
