"""Writing model directories: the final output and every checkpoint-N a complete, pickle-free Hugging Face model
directory (config.json with auto_map, both model .py files, model.safetensors, generation_config.json, the
tokenizer saved by `minimind.tokenizer.save_tokenizer`, training_args.json in place of Trainer's pickled
training_args.bin); checkpoint-N renamed into place only once complete; a full disk as one line for the user."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from minimind.distributed import restore_model_code
from minimind.errors import InputError
from minimind.tokenizer import save_tokenizer
from minimind.training.checkpoints import checkpoint_dirs


def finish_hf_directory(output_dir, tokenizer, training_args=None):
    """Make a directory that save_pretrained wrote a complete, pickle-free HF model directory."""
    save_tokenizer(tokenizer, output_dir)
    pickled_args = Path(output_dir) / "training_args.bin"  # torch.save'd by Trainer, read by nothing
    if pickled_args.exists():
        pickled_args.unlink()
    if training_args is not None:
        (Path(output_dir) / "training_args.json").write_text(training_args.to_json_string(), encoding="utf-8")


def save_hf_directory(model, tokenizer, output_dir, training_args=None):
    model.save_pretrained(output_dir)
    finish_hf_directory(output_dir, tokenizer, training_args)


# Checkpoints are assembled here, inside --output_dir (same filesystem, so the final rename is atomic) and outside
# the `checkpoint-*` names that Trainer's rotation and our resume look at.
STAGING_DIR = ".checkpoint-staging"


class HFDirectoryMixin:
    """Trainer mixin: the final save and every checkpoint-N go through `_save`, so all are complete HF dirs; and
    checkpoint-N appears only complete.

    transformers (5.17 to 5.24) writes a checkpoint straight into `checkpoint-N`, so a kill during a save leaves a
    partial directory, and saving step N over an older `checkpoint-N` mixes old and new files. Here Trainer writes
    it into `<output_dir>/.checkpoint-staging/checkpoint-N`; once every process has finished, it is renamed to
    `checkpoint-N` (an older one of that name is moved aside first) and only then are old checkpoints rotated
    out. A kill at any moment leaves the previous checkpoints complete and `checkpoint-N` either absent or
    complete. With --push_to_hub Trainer uploads the checkpoint directory in the background, so it is written
    in place as transformers does."""

    _staging_root = None

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            restore_model_code(self.model, output_dir or self.args.output_dir)  # FSDP2 saves torch's code instead
            finish_hf_directory(output_dir or self.args.output_dir, self.processing_class, self.args)

    def _get_output_dir(self, trial):
        return self._staging_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        if self.args.push_to_hub:
            return super()._save_checkpoint(model, trial)
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = run_dir / STAGING_DIR
        staged, final, replaced = staging_root / name, run_dir / name, staging_root / f"replaced-{name}"
        if self.args.should_save:  # what a killed save of this step left behind
            shutil.rmtree(staged, ignore_errors=True)
            shutil.rmtree(replaced, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_root = str(staging_root)
        try:
            super()._save_checkpoint(model, trial)
        except Exception as error:
            raise self._full_disk_error(error, run_dir, staging_root, name) or error  # noqa: B904 (the same error)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()  # every rank has written its RNG (and sharded) state
        if not self.args.should_save:
            return
        best = self.state.best_model_checkpoint
        try:
            if best is not None and Path(best).parent == staging_root:
                # Trainer recorded the staging path as the best checkpoint; record where it will live instead.
                self.state.best_model_checkpoint = str(run_dir / Path(best).name)
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))
            _fsync_tree(staged)  # so that a power cut cannot reorder the rename before the data
        except Exception as error:
            raise self._full_disk_error(error, run_dir, staging_root, name) or error  # noqa: B904 (the same error)
        if final.exists():
            os.replace(final, replaced)
        os.replace(staged, final)
        _fsync_tree(run_dir, files=False)
        shutil.rmtree(staging_root, ignore_errors=True)
        # Trainer rotated inside the staging directory (a no-op); rotate the real checkpoints now that N exists.
        rotate_checkpoints(
            output_dir=str(run_dir),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _full_disk_error(self, error, run_dir, staging_root, name):
        """The InputError for a checkpoint save that failed on a full filesystem (None for any other failure, which
        keeps its traceback). The staged files are removed: they are no checkpoint, and the room they take is what
        the user must find."""
        need, basis = self._checkpoint_size_estimate(run_dir)
        if not disk_is_full(error, run_dir, need):
            return None
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)
        previous = checkpoint_dirs(run_dir)
        kept = (
            f"The newest earlier checkpoint, {previous[max(previous)].name}, is intact."
            if previous
            else "No checkpoint was saved before it."
        )
        return full_disk_error(error, run_dir, f"{name} (the unfinished save was removed)", need, basis, kept)

    def _checkpoint_size_estimate(self, run_dir):
        """(bytes, what that figure is) for one checkpoint: the newest one's size, else the model's parameters plus
        the optimizer's state tensors."""
        steps = checkpoint_dirs(run_dir)
        if steps:
            newest = steps[max(steps)]
            return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()), f"the size of {newest.name}"
        tensors = list(self.model.parameters())
        if self.optimizer is not None:
            tensors += [
                value for state in self.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
            ]
        return sum(t.numel() * t.element_size() for t in tensors), "the model's parameters plus optimizer state"


def disk_is_full(error, directory, need):
    """Whether a save into `directory` failed for want of space. An OSError says so by errno, safetensors (a Rust
    writer) only in its message, and torch.save's zip writer not at all (its RuntimeError names a stream position),
    so less free room than the save needs counts too."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(error) or "Disk quota exceeded" in str(error):
        return True
    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def _size(count):
    for unit in ("bytes", "kB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def full_disk_error(error, directory, what, need, basis, kept):
    """One line for the user: which filesystem is full, how much the save needs and has, what survived, the fix."""
    cause = " ".join(str(error).split())
    cause = f"{type(error).__name__}: {cause[:200]}{'...' if len(cause) > 200 else ''}"
    return InputError(
        f"no space left on the filesystem of {directory}: saving {what} failed ({cause}). It needs "
        f"about {_size(need)} ({basis}); {_size(shutil.disk_usage(directory).free)} is free. {kept} "
        "Fix: free space there, or pass an --output_dir on a larger filesystem (copying the "
        "checkpoints along), then rerun with --resume_from_checkpoint last."
    )


# What a checkpoint holds for resuming only (names, or the start of names of files and of sharded directories).
RESUME_ONLY_FILES = ("optimizer", "scheduler", "scaler", "rng_state", TRAINER_STATE_NAME)


def _file_stamps(directory):
    return (
        {
            path.name: (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            for path in Path(directory).iterdir()
            if path.is_file() and (stat := path.stat())
        }
        if Path(directory).is_dir()
        else {}
    )


def save_final_model(trainer, output_dir):
    """trainer.save_model(output_dir), with a full disk an InputError. The files this save had written are removed
    then: a half-written model.safetensors, or new weights beside an older run's config, would load as neither."""
    before = _file_stamps(output_dir)
    try:
        trainer.save_model(output_dir)
    except Exception as error:
        steps = checkpoint_dirs(output_dir)
        if steps:  # the final directory is a checkpoint without what only a resume reads
            newest = steps[max(steps)]
            need = sum(
                f.stat().st_size
                for f in newest.rglob("*")
                if f.is_file() and not f.relative_to(newest).parts[0].startswith(RESUME_ONLY_FILES)
            )
            basis = f"{newest.name} without its optimizer, scheduler and RNG state"
        else:
            need = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            basis = "the model's parameters alone"
        if not disk_is_full(error, output_dir, need):
            raise
        if trainer.args.should_save:
            for name, stamp in _file_stamps(output_dir).items():
                if before.get(name) != stamp:
                    (Path(output_dir) / name).unlink(missing_ok=True)
        kept = "Its checkpoints are intact." if steps else "No checkpoint was saved."
        raise full_disk_error(
            error, output_dir, "the final model (its partial files were removed)", need, basis, kept
        ) from error


def _fsync_tree(path, files=True):
    """Flush `path` (a directory) and, with files=True, everything below it to disk."""
    paths = [path, *(p for p in Path(path).rglob("*"))] if files else [path]
    for item in paths:
        if not (item.is_dir() or item.is_file()):
            continue
        try:
            fd = os.open(item, os.O_RDONLY)
        except OSError:  # directories cannot be opened on every platform (Windows)
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
