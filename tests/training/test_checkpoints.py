"""Fault injection: damaged checkpoints of every kind and bad data files each give a clear, named error or a
named fallback, never silently lost state or a bare traceback.

One tiny pretraining run (checkpoint-2 and checkpoint-4) is made once; each test damages a copy of it.
"""

import copy
import json
import logging
import os
import random
import shutil
import types
from pathlib import Path

import pytest

from conftest import ROOT, load_script
from minimind.errors import InputError

TINY_MODEL = [
    "--hidden_size",
    "32",
    "--num_hidden_layers",
    "1",
    "--num_attention_heads",
    "2",
    "--num_key_value_heads",
    "1",
    "--intermediate_size",
    "48",
]
FAST = [
    "--use_cpu",
    "--report_to",
    "none",
    "--max_seq_length",
    "32",
    "--per_device_train_batch_size",
    "2",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
    "--seed",
    "0",
    "--eval_fraction",
    "0",
    "--learning_rate",
    "3e-3",
]
CHECKPOINTED = ["--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "3"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory):
    lines = Path(ROOT, "data", "pretrain.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:40]
    path = tmp_path_factory.mktemp("data") / "pretrain.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


def run_argv(data_path, output_dir, max_steps):
    return [
        "--data_path",
        data_path,
        "--output_dir",
        str(output_dir),
        "--max_steps",
        str(max_steps),
        *TINY_MODEL,
        *FAST,
        *CHECKPOINTED,
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory, pretrain_data):
    """(output_dir, training_args) of a 4-step run that saved checkpoint-2 and checkpoint-4."""
    out = tmp_path_factory.mktemp("run")
    trainer, _ = load_script("pretrain").main(run_argv(pretrain_data, out, 4))
    return out, trainer.args


@pytest.fixture
def run_copy(run, tmp_path):
    """A private copy of the run and training arguments pointing at it, with --resume_from_checkpoint last."""
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    args = copy.copy(run[1])
    args.output_dir, args.resume_from_checkpoint = str(out), "last"
    return out, args


def truncate(path):
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size // 2)


def damage(path, how):
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        truncate(path)
    elif how == "emptied":
        path.write_bytes(b"")
    elif how == "garbage":  # as long as before, every byte random
        path.write_bytes(random.Random(0).randbytes(path.stat().st_size))
    else:
        raise AssertionError(how)


def test_saves_are_complete_with_no_staging(run):
    """Saves leave complete checkpoints and no staging."""
    from minimind.training import STAGING_DIR, checkpoint_problems

    out, args = run
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    assert not (out / STAGING_DIR).exists()
    for name in ("checkpoint-2", "checkpoint-4"):
        assert checkpoint_problems(out / name, args) == []
        assert {
            "model.safetensors",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state.pth",
            "trainer_state.json",
            "config.json",
            "modeling_minimind.py",
        } <= set(os.listdir(out / name))
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


CHECKPOINT_FILES = [
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
    "config.json",
]
# Trainer reads config.json only when it is there, so only its damage counts.
DAMAGE = [
    (name, how)
    for name in CHECKPOINT_FILES
    for how in ("deleted", "truncated", "emptied", "garbage")
    if (name, how) != ("config.json", "deleted")
]


def expected_problem(name, how):
    return f"{name} is missing" if how == "deleted" else f"{name} is damaged"


@pytest.mark.parametrize("name, how", DAMAGE)
def test_last_skips_damaged_naming_the_file(run_copy, caplog, name, how):
    """Last falls back past a damaged checkpoint naming the file."""
    from minimind.training import resolve_resume_checkpoint

    out, args = run_copy
    damage(out / "checkpoint-4" / name, how)
    with caplog.at_level(logging.WARNING, logger="minimind.training"):
        assert resolve_resume_checkpoint(args) == str(out / "checkpoint-2")
    assert f"not resuming from {out / 'checkpoint-4'}: {expected_problem(name, how)}" in caplog.text


@pytest.mark.parametrize("name, how", DAMAGE)
def test_explicit_damaged_is_refused(run_copy, name, how):
    """Explicit damaged checkpoint is refused naming the file."""
    from minimind.training import resolve_resume_checkpoint

    out, args = run_copy
    damage(out / "checkpoint-4" / name, how)
    args.resume_from_checkpoint = str(out / "checkpoint-4")
    with pytest.raises(ValueError) as info:
        resolve_resume_checkpoint(args)
    message = str(info.value)
    assert message.startswith(
        f"--resume_from_checkpoint {out / 'checkpoint-4'}: not a complete checkpoint: {expected_problem(name, how)}"
    )
    assert message.endswith(
        "Fix: restore the file(s), or pass --resume_from_checkpoint last to take the newest complete checkpoint."
    )


def test_safetensors_off_by_one_byte_damaged(run_copy):
    """Safetensors one byte short or long is damaged."""
    from minimind.training import checkpoint_problems

    out, args = run_copy
    weights = out / "checkpoint-4" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])
    assert checkpoint_problems(out / "checkpoint-4", args) == [
        f"model.safetensors is damaged ({len(data) - 1} bytes where its header promises {len(data)})"
    ]
    weights.write_bytes(data + b"\0")
    assert checkpoint_problems(out / "checkpoint-4", args)[0].startswith("model.safetensors is damaged")
    weights.write_bytes(data)
    assert checkpoint_problems(out / "checkpoint-4", args) == []


def test_adapter_and_shards_are_checked(run_copy):
    """LoRA checkpoints hold adapter_model.safetensors; large models a safetensors index and its shards."""
    from minimind.training import checkpoint_problems

    out, args = run_copy
    checkpoint = out / "checkpoint-4"
    (checkpoint / "model.safetensors").rename(checkpoint / "adapter_model.safetensors")
    assert checkpoint_problems(checkpoint, args) == []
    truncate(checkpoint / "adapter_model.safetensors")
    assert checkpoint_problems(checkpoint, args)[0].startswith("adapter_model.safetensors is damaged")

    (checkpoint / "adapter_model.safetensors").unlink()
    shutil.copy(out / "checkpoint-2" / "model.safetensors", checkpoint / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_problems(checkpoint, args) == ["model-00002-of-00002.safetensors is missing"]
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert checkpoint_problems(checkpoint, args)[0].startswith("model.safetensors.index.json is damaged")
    (checkpoint / "model.safetensors.index.json").unlink()
    assert checkpoint_problems(checkpoint, args) == ["model.safetensors is missing (no model weights)"]


def test_trainer_state_without_a_step_is_damaged(run_copy):
    from minimind.training import checkpoint_problems

    out, args = run_copy
    (out / "checkpoint-4" / "trainer_state.json").write_text('{"log_history": []}')
    assert checkpoint_problems(out / "checkpoint-4", args) == [
        "trainer_state.json is damaged (no integer global_step)"
    ]


def test_every_problem_is_listed(run_copy):
    from minimind.training import checkpoint_problems

    out, args = run_copy
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    truncate(out / "checkpoint-4" / "scheduler.pt")
    problems = checkpoint_problems(out / "checkpoint-4", args)
    assert problems[0] == "optimizer.pt is missing" and problems[1].startswith("scheduler.pt is damaged")
    assert len(problems) == 2


def test_required_files_follow_arguments(run_copy):
    """--save_only_model resumes need no optimizer, scheduler or RNG files; a 2-process resume needs each
    process's RNG state; a run with a gradient scaler (fp16) needs scaler.pt."""
    from minimind.training import checkpoint_problems

    out, args = run_copy
    checkpoint = out / "checkpoint-4"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (checkpoint / name).unlink()
    assert checkpoint_problems(checkpoint, types.SimpleNamespace(save_only_model=True)) == []
    assert checkpoint_problems(checkpoint, args) == [
        "optimizer.pt is missing",
        "scheduler.pt is missing",
        "rng_state.pth is missing",
    ]

    shutil.copytree(out / "checkpoint-2", out / "checkpoint-6")
    two_processes = types.SimpleNamespace(save_only_model=False, world_size=2, deepspeed=None)
    (out / "checkpoint-6" / "rng_state.pth").rename(out / "checkpoint-6" / "rng_state_0.pth")
    assert checkpoint_problems(out / "checkpoint-6", two_processes) == ["rng_state_1.pth is missing"]
    assert checkpoint_problems(out / "checkpoint-6", args, scaler=True) == [
        "rng_state.pth is missing",
        "scaler.pt is missing",
    ]


def test_last_with_none_complete_refuses(run_copy, caplog):
    """Last with no complete checkpoint refuses instead of starting over."""
    from minimind.training import resolve_resume_checkpoint

    out, args = run_copy
    (out / "checkpoint-2" / "optimizer.pt").unlink()
    (out / "checkpoint-4" / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="minimind.training"):
        with pytest.raises(
            ValueError,
            match=r"no checkpoint in .* is complete .*Fix: restore those files, or move "
            r"the checkpoint directories away to start from scratch\.",
        ):
            resolve_resume_checkpoint(args)
    assert "checkpoint-4: model.safetensors is missing" in caplog.text
    assert "checkpoint-2: optimizer.pt is missing" in caplog.text


def test_last_with_none_yet_starts_fresh(tmp_path, caplog):
    """Last with no checkpoint yet starts from scratch."""
    from minimind.training import resolve_resume_checkpoint

    args = types.SimpleNamespace(resume_from_checkpoint="last", output_dir=str(tmp_path / "new"))
    with caplog.at_level(logging.WARNING, logger="minimind.training"):
        assert resolve_resume_checkpoint(args) is None
    assert "no checkpoint in" in caplog.text and "starting from scratch" in caplog.text


def test_resume_skips_missing_optimizer(run_copy, pretrain_data, capsys):
    """The measured bug: with the newest optimizer.pt deleted, `--resume_from_checkpoint last` used to continue
    from it with a fresh Adam state and no warning. Now it warns and resumes from checkpoint-2."""
    out, _ = run_copy
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    trainer, _ = load_script("pretrain").main([*run_argv(pretrain_data, out, 6), "--resume_from_checkpoint", "last"])
    # The commands log to stdout (setup_run replaces the root logger's handlers, pytest's too).
    assert (
        f"WARNING minimind.training: not resuming from {out / 'checkpoint-4'}: optimizer.pt is missing; "
        "falling back to an older checkpoint"
    ) in capsys.readouterr().out
    assert trainer.state.global_step == 6
    # Resumed at step 2: steps 3 to 6 were trained again, and checkpoint-4 was rewritten whole.
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoint-4" / "optimizer.pt").is_file()


def test_resume_names_truncated_weights(run_copy, pretrain_data, capsys):
    """Resume command with truncated weights names file and checkpoint."""
    out, _ = run_copy
    truncate(out / "checkpoint-4" / "model.safetensors")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        load_script("pretrain").main(
            [*run_argv(pretrain_data, out, 6), "--resume_from_checkpoint", str(out / "checkpoint-4")]
        )
    assert info.value.code == 2
    assert the_error_line(capsys).startswith(
        f"error: --resume_from_checkpoint {out / 'checkpoint-4'}: not a complete "
        "checkpoint: model.safetensors is damaged"
    )


@pytest.mark.parametrize("name", ["scheduler.pt", "rng_state.pth"])
def test_archive_with_bad_pickle_is_damaged(run_copy, name):
    """The zip's directory intact, bytes inside its pickle overwritten: only loading it as Trainer does (what the
    check does for these small files) finds that, instead of an UnpicklingError traceback at resume."""
    import zipfile

    from minimind.training import checkpoint_problems

    out, args = run_copy
    path = out / "checkpoint-4" / name
    with zipfile.ZipFile(path) as archive:
        pickle = next(info for info in archive.infolist() if info.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    local = pickle.header_offset  # the local header's name and extra lengths (torch pads the extra for alignment)
    start = (
        local
        + 30
        + int.from_bytes(data[local + 26 : local + 28], "little")
        + int.from_bytes(data[local + 28 : local + 30], "little")
    )
    data[start + 2 : start + 10] = b"\xff" * 8  # past the protocol opcode
    path.write_bytes(bytes(data))
    assert checkpoint_problems(out / "checkpoint-4", args) == [
        f"{name} is damaged (torch.load fails: UnpicklingError: Unsupported operand 255)"
    ]


@pytest.mark.parametrize("name", ["config.json", "scheduler.pt"])
def test_resume_skips_damaged_config(run_copy, pretrain_data, capsys, name):
    """These used to end the resumed run with a JSON or pickle traceback; now the command names the file and
    resumes from checkpoint-2."""
    out, _ = run_copy
    damage(out / "checkpoint-4" / name, "garbage")
    trainer, _ = load_script("pretrain").main([*run_argv(pretrain_data, out, 6), "--resume_from_checkpoint", "last"])
    assert (
        f"WARNING minimind.training: not resuming from {out / 'checkpoint-4'}: {name} is damaged ("
        in capsys.readouterr().out
    )
    assert trainer.state.global_step == 6
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2, 3, 4, 5, 6]


def test_killed_save_leaves_no_directory(pretrain_data, tmp_path, monkeypatch):
    """Checkpoints are written to a staging directory and renamed when whole: a save that dies after the weights
    (here: while writing the RNG state of step 4) leaves checkpoint-2 as the newest checkpoint, and the next
    resume continues from it and cleans up."""
    from minimind import training

    out = tmp_path / "run"
    original = training.CausalLMTrainer._save_rng_state

    def dying_save(self, output_dir):
        if self.state.global_step == 4:
            raise RuntimeError("simulated kill during save")
        return original(self, output_dir)

    monkeypatch.setattr(training.CausalLMTrainer, "_save_rng_state", dying_save)
    with pytest.raises(RuntimeError, match="simulated kill"):
        load_script("pretrain").main(run_argv(pretrain_data, out, 4))
    staged = out / training.STAGING_DIR / "checkpoint-4"
    assert (staged / "model.safetensors").is_file() and (staged / "optimizer.pt").is_file()
    assert not (out / "checkpoint-4").exists()
    assert training.latest_complete_checkpoint(out) == str(out / "checkpoint-2")

    monkeypatch.setattr(training.CausalLMTrainer, "_save_rng_state", original)
    trainer, _ = load_script("pretrain").main([*run_argv(pretrain_data, out, 4), "--resume_from_checkpoint", "last"])
    assert trainer.state.global_step == 4
    assert training.checkpoint_problems(out / "checkpoint-4", trainer.args) == []
    assert not (out / training.STAGING_DIR).exists()


def full_disk_at(monkeypatch, target, fail=lambda path: True, error=None):
    """Make the save of files named `target` write half their bytes and then fail as a full disk does: with ENOSPC,
    or with `error` (what torch.save's zip writer raises instead)."""
    import errno

    import torch
    import transformers.modeling_utils

    weights = target == "model.safetensors"
    module, name = (transformers.modeling_utils, "safe_save_file") if weights else (torch, "save")
    original = getattr(module, name)

    def save(obj, path, *args, **kwargs):
        if Path(path).name == target and fail(Path(path)):
            Path(path).write_bytes(b"\0" * 100)
            raise error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(module, name, save)
    return lambda: monkeypatch.setattr(module, name, original)


def tree_size(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def the_error_line(capsys):
    """The command's one `error:` line; the rest of stderr is progress bars, and no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


FULL_DISK = {
    "model.safetensors": "OSError: [Errno 28] No space left on device",
    "optimizer.pt": "OSError: [Errno 28] No space left on device",
    "rng_state.pth": "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534",
}


@pytest.mark.parametrize("target", FULL_DISK)
def test_full_disk_mid_save_loses_nothing(pretrain_data, tmp_path, monkeypatch, capsys, target):
    """ENOSPC while checkpoint-4 is written (the weights, the optimizer state, or torch.save's zip writer, which says
    nothing of the disk: then the free space tells) ends the command with one line naming the filesystem and the
    room needed; the staged files are gone, checkpoint-2 is intact, and a rerun resumes from it."""
    import shutil as shutil_module

    from minimind import cli, training

    out = tmp_path / "run"
    restore = full_disk_at(
        monkeypatch,
        target,
        fail=lambda path: path.parent.name == "checkpoint-4",
        error=None if target != "rng_state.pth" else RuntimeError(FULL_DISK[target][14:]),
    )
    if target == "rng_state.pth":
        disk_usage = shutil_module.disk_usage
        monkeypatch.setattr(shutil_module, "disk_usage", lambda path: disk_usage(path)._replace(free=1000))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.pretrain(run_argv(pretrain_data, out, 4))
    assert info.value.code == 2
    error = the_error_line(capsys)
    need = training._size(tree_size(out / "checkpoint-2"))
    prefix = (
        f"error: no space left on the filesystem of {out}: saving checkpoint-4 (the unfinished save was "
        f"removed) failed ({FULL_DISK[target]}). It needs about {need} (the size of checkpoint-2); "
    )
    assert error.startswith(prefix), error
    assert error[len(prefix) :].split(" is free. ")[1] == (
        "The newest earlier checkpoint, checkpoint-2, is intact. Fix: free space there, or pass an --output_dir on a "
        "larger filesystem (copying the checkpoints along), then rerun with --resume_from_checkpoint last."
    )
    assert not (out / training.STAGING_DIR).exists() and not (out / "checkpoint-4").exists()
    assert training.checkpoint_problems(out / "checkpoint-2") == []
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    restore()
    monkeypatch.undo()
    trainer, _ = cli.pretrain([*run_argv(pretrain_data, out, 4), "--resume_from_checkpoint", "last"])
    assert trainer.state.global_step == 4
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2, 3, 4]
    assert training.checkpoint_problems(out / "checkpoint-4", trainer.args) == []


def test_full_disk_final_save_cleans_up(pretrain_data, tmp_path, monkeypatch, capsys):
    """A full disk at the final save removes its partial files."""
    from minimind import cli, training

    out = tmp_path / "run"
    full_disk_at(monkeypatch, "model.safetensors", fail=lambda path: path.parent == out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.pretrain(run_argv(pretrain_data, out, 4))
    assert info.value.code == 2
    error = the_error_line(capsys)
    assert error.startswith(
        f"error: no space left on the filesystem of {out}: saving the final model (its partial "
        "files were removed) failed (OSError: [Errno 28] No space left on device). It needs "
        "about "
    )
    resume_only = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")
    need = sum(f.stat().st_size for f in (out / "checkpoint-4").iterdir() if f.name not in resume_only)
    assert f"about {training._size(need)} (checkpoint-4 without its optimizer, scheduler and RNG state); " in error
    assert " is free. Its checkpoints are intact. Fix: " in error
    # config.json, written before the weights, went with them: nothing of the unfinished model is left.
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == []
    assert training.checkpoint_problems(out / "checkpoint-4") == []

    monkeypatch.undo()
    trainer, _ = cli.pretrain([*run_argv(pretrain_data, out, 4), "--resume_from_checkpoint", "last"])
    # >= : transformers 5.24, resumed from a checkpoint at max_steps, trains one step more before it stops.
    assert trainer.state.global_step >= 4 and training.checkpoint_problems(out / "checkpoint-4") == []
    assert not training._safetensors_problem(out / "model.safetensors")


def test_save_over_existing_replaces_whole(run_copy, pretrain_data):
    """Resuming from checkpoint-2 re-saves checkpoint-4: the new one replaces the old directory (no mix of the
    two runs' files, and no file left over from the old one)."""
    out, _ = run_copy
    (out / "checkpoint-4" / "stale-marker.txt").write_text("from the first run")
    load_script("pretrain").main(
        [*run_argv(pretrain_data, out, 4), "--resume_from_checkpoint", str(out / "checkpoint-2")]
    )
    assert not (out / "checkpoint-4" / "stale-marker.txt").exists()
    assert (out / "checkpoint-4" / "optimizer.pt").is_file()


def test_best_recorded_at_final_path(pretrain_data, tmp_path):
    """Trainer records the best checkpoint by the path it saved to; staged saves must record checkpoint-N."""
    out = tmp_path / "run"
    trainer, _ = load_script("pretrain").main(
        [
            *run_argv(pretrain_data, out, 4),
            "--eval_fraction",
            "0.2",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--load_best_model_at_end",
            "--metric_for_best_model",
            "eval_loss",
        ]
    )
    best = trainer.state.best_model_checkpoint
    assert best in (str(out / "checkpoint-2"), str(out / "checkpoint-4"))
    saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert saved == best


# --------------------------------------------------------------------------------------------------------------
# Bad data files
# --------------------------------------------------------------------------------------------------------------


def run_command(name, argv):
    return load_script(name).main([*argv, *TINY_MODEL, *FAST, "--max_steps", "1", "--save_strategy", "no"])


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_bad_data_path_is_a_clear_error(tmp_path, capsys, kind):
    """Bad data path is a clear error without traceback."""
    path = tmp_path / "nope.jsonl"
    if kind == "directory":
        path = tmp_path / "a_dir"
        path.mkdir()
    with pytest.raises(SystemExit) as info:
        run_command("pretrain", ["--data_path", str(path), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    expected = "no such file. Fix: check the path" if kind == "missing" else "is a directory, not a JSONL file. Fix:"
    assert f"error: {path}: {expected}" in err


def test_malformed_line_is_named_by_the_command(tmp_path, capsys):
    path = tmp_path / "sft.jsonl"
    path.write_text(
        '{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"conversations": [{"role": "gpt", "content": "hi"}]}\n',
        encoding="utf-8",
    )
    with pytest.raises(SystemExit) as info:
        run_command("sft", ["--data_path", str(path), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"error: {path}, line 2: 'conversations' message 0 has unknown role 'gpt'. Fix: " in err


GOOD_LINES = {
    "pretrain": '{"text": "The sky is blue."}',
    "sft": '{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}',
}
UNENCODABLE = {
    "pretrain": (
        '{"text": "caf\\ud800"}',
        "the string at ['text'] is not valid Unicode (lone surrogate "
        "'\\ud800' at character 3, from a \\uXXXX escape that is half of a pair)",
    ),
    "sft": (
        '{"conversations": [{"role": "user", "content": "\\ud800"}]}',
        "the string at "
        "['conversations'][0]['content'] is not valid Unicode (lone surrogate '\\ud800' at character "
        "0, from a \\uXXXX escape that is half of a pair)",
    ),
}


@pytest.mark.parametrize("fault", ["surrogate", "nesting"])
@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_command_names_unencodable_line(tmp_path, capsys, kind, fault):
    """A lone surrogate used to end training with a UnicodeEncodeError from the tokenizer, 100,000 nested brackets
    with a RecursionError: both tracebacks. Now the command names the line; --skip_bad_lines trains on the rest."""
    from minimind import cli

    bad, problem = (
        UNENCODABLE[kind]
        if fault == "surrogate"
        else ("[" * 100_000 + "]" * 100_000, "arrays/objects nested more than 100 levels deep")
    )
    path = tmp_path / f"{kind}.jsonl"
    path.write_text(f"{GOOD_LINES[kind]}\n{bad}\n" + f"{GOOD_LINES[kind]}\n" * 8, encoding="utf-8")
    argv = [
        "--data_path",
        str(path),
        "--output_dir",
        str(tmp_path / "out"),
        *TINY_MODEL,
        *FAST,
        "--max_steps",
        "1",
        "--save_strategy",
        "no",
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        getattr(cli, kind)(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}, line 2: {problem}. Fix: "
        + (
            "replace the escape with the intended character"
            if fault == "surrogate"
            else "flatten the line (no training format nests that deep)"
        )
        + ", or pass --skip_bad_lines to skip such lines."
    ]
    if kind == "pretrain":
        trainer, _ = cli.pretrain([*argv, "--skip_bad_lines", "--padding_free"])
        assert len(trainer.train_dataset) == 9 and trainer.state.global_step == 1


def test_dpo_pair_prompt_mismatch_refused(tmp_path, capsys):
    """DPO pair with different prompts is refused at load time."""
    good = {
        "chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}],
    }
    bad = {"chosen": good["chosen"], "rejected": [{"role": "user", "content": "other Q"}, good["rejected"][1]]}
    path = tmp_path / "dpo.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        run_command("dpo", ["--data_path", str(path), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert (
        f"error: {path}, line 2: 'chosen' and 'rejected' have different prompts (they differ at message 0; "
        "1 and 1 messages before the final reply). Fix: give both the same messages"
    ) in err


def test_utf8_bom_is_accepted(tmp_path):
    from minimind.data import read_jsonl

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    rows, skipped = read_jsonl(path, "pretrain")
    assert (rows, skipped) == ([{"text": "first"}, {"text": "second"}], 0)
    # Only at the start of the file: a BOM in the middle is not JSON whitespace.
    path.write_bytes(b'{"text": "first"}\n\xef\xbb\xbf{"text": "second"}\n')
    with pytest.raises(ValueError, match=r"bom\.jsonl, line 2: invalid JSON"):
        read_jsonl(path, "pretrain")


# ----------------------------------------------------------------------------------------------------------
# Damaged model directories
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [["tokenizer.json"], ["tokenizer.json", "tokenizer_config.json"]])
def test_missing_tokenizer_files_are_named(tmp_path, missing):
    """A model directory without tokenizer files names them."""
    from conftest import model_dir
    from minimind.chat import load_model_and_tokenizer

    model_dir(tmp_path)
    for name in missing:
        (tmp_path / name).unlink()
    with pytest.raises(InputError) as raised:
        load_model_and_tokenizer(str(tmp_path), device="cpu")
    assert str(raised.value) == (
        f"{tmp_path}: tokenizer file(s) {', '.join(missing)} missing. Fix: copy them from the directory the model "
        f"was trained with (every saved MiniMind model and the bundled tokenizer/ directory have them)."
    )


def test_chat_loader_names_truncated_weights(tmp_path):
    """A truncated weights file in a model directory is named by the chat loader."""
    from conftest import model_dir
    from minimind.chat import load_model_and_tokenizer

    model_dir(tmp_path)
    weights = tmp_path / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as file:
        file.truncate(size - 10)
    with pytest.raises(
        InputError,
        match=rf"^{weights} \({size - 10} bytes where its header promises {size}\): "
        r"the safetensors file is incomplete or damaged",
    ):
        load_model_and_tokenizer(str(tmp_path), device="cpu")
