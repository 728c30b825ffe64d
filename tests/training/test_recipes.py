"""Training scripts and core (minimind/training/) on tiny settings: every script end to end, LoRA merge,
DPO margins, distillation, data errors, kill -9 + resume, and 2-process vs 1-process training."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, TINY_MODEL, head, load_script

FAST = [
    "--use_cpu",
    "--report_to",
    "none",
    "--max_seq_length",
    "32",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "8",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
    "--seed",
    "0",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Small slices of the bundled corpus."""
    d = tmp_path_factory.mktemp("data")
    return {
        "pretrain": head(os.path.join(ROOT, "data", "pretrain.jsonl"), d / "pretrain.jsonl", 150),
        "sft": head(os.path.join(ROOT, "data", "sft.jsonl"), d / "sft.jsonl", 48),
        "dpo": head(os.path.join(ROOT, "data", "dpo.jsonl"), d / "dpo.jsonl", 16),
    }


def logged_losses(trainer, key="loss"):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def load_remote(path):
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, data):
    """A tiny model pretrained for a few steps by scripts/pretrain.py: (output_dir, trainer, metrics)."""
    out = tmp_path_factory.mktemp("pretrain")
    trainer, metrics = load_script("pretrain").main(
        [
            "--data_path",
            data["pretrain"],
            "--output_dir",
            str(out),
            "--max_steps",
            "12",
            "--learning_rate",
            "3e-3",
            "--eval_fraction",
            "0.1",
            *TINY_MODEL,
            *FAST,
        ]
    )
    return str(out), trainer, metrics


def test_pretrain_writes_loss_curves(pretrained):
    """Pretrain writes its loss curves as a table and a plot."""
    out, trainer, _ = pretrained
    history = trainer.state.log_history
    train = {e["step"]: f"{e['loss']:.4f}" for e in history if "loss" in e}
    evaluation = {e["step"]: f"{e['eval_loss']:.4f}" for e in history if "eval_loss" in e}
    assert len(train) >= 2 and evaluation
    lines = Path(out, "loss_curve.md").read_text().splitlines()
    assert lines[:2] == ["| step | training loss | eval loss |", "|---:|---:|---:|"]
    assert lines[2:] == [
        f"| {step} | {train.get(step, '')} | {evaluation.get(step, '')} |" for step in sorted({*train, *evaluation})
    ]
    from matplotlib.image import imread

    plot = imread(Path(out, "loss_curve.png"))
    assert plot.ndim == 3 and plot.shape[0] > 100 and plot.shape[1] > 100


def test_pretrain_writes_loadable_directory(pretrained):
    """Pretrain writes complete loadable HF directory."""
    out, trainer, metrics = pretrained
    losses = logged_losses(trainer)
    assert trainer.state.global_step == 12 and losses[-1] < losses[0] - 0.3, losses
    # Perplexity is exp(eval loss), reported with the metrics and saved with them.
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert json.loads(Path(out, "all_results.json").read_text())["eval_perplexity"] == metrics["eval_perplexity"]
    assert any("eval_perplexity" in entry for entry in trainer.state.log_history)

    files = set(os.listdir(out))
    assert {
        "config.json",
        "configuration_minimind.py",
        "modeling_minimind.py",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "loss_curve.md",
        "loss_curve.png",
    } <= files
    assert "training_args.bin" not in files and not any(f.endswith((".bin", ".pt", ".pth")) for f in files)
    assert (
        json.loads(Path(out, "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
        == "modeling_minimind.MiniMindForCausalLM"
    )
    assert json.loads(Path(out, "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    generation = json.loads(Path(out, "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["pad_token_id"]) == (1, 0)
    assert generation["eos_token_id"] in (2, [2])  # 5.17's Trainer stores it as a list

    reloaded = load_remote(out)
    assert type(reloaded).__name__ == "MiniMindForCausalLM"
    ids = torch.tensor([[1, 300, 301, 302, 303]])
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trainer.model.eval(), ids))


def test_sft_pads_batches_and_chats_after_reload(pretrained, data, tmp_path):
    out = tmp_path / "sft"
    trainer, metrics = load_script("sft").main(
        [
            "--model_name_or_path",
            pretrained[0],
            "--data_path",
            data["sft"],
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--learning_rate",
            "3e-3",
            "--eval_fraction",
            "0.2",
            "--max_seq_length",
            "96",
            *FAST,
        ]
    )
    assert trainer.state.global_step == 4 and math.isfinite(metrics["eval_perplexity"])
    # SFT rows have different lengths: the collator pads per batch, with -100 labels on the padding.
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["attention_mask"] == 0).any() and (batch["labels"][batch["attention_mask"] == 0] == -100).all()

    model = load_remote(out)
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    reply = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert reply.shape[1] > prompt["input_ids"].shape[1]


def test_padding_free_sft_gives_the_padded_loss(pretrained, data, tmp_path):
    """--padding_free trains on the same batches as padded SFT, each batch one row without a padding token, and
    gives the same losses: the model keeps attention inside each chat of the row."""
    losses, trainers = {}, {}
    for name, extra in (("padded", []), ("padding_free", ["--padding_free"])):
        trainers[name], _ = load_script("sft").main(
            [
                "--model_name_or_path",
                pretrained[0],
                "--data_path",
                data["sft"],
                "--output_dir",
                str(tmp_path / name),
                "--max_steps",
                "3",
                "--learning_rate",
                "3e-3",
                "--eval_fraction",
                "0",
                "--max_seq_length",
                "96",
                *FAST,
                *extra,
            ]
        )
        losses[name] = logged_losses(trainers[name])
    assert losses["padding_free"] == pytest.approx(losses["padded"], abs=1e-5), losses

    padded = next(iter(trainers["padded"].get_train_dataloader()))
    flat = next(iter(trainers["padding_free"].get_train_dataloader()))
    real = padded["attention_mask"].bool()
    assert flat["input_ids"].shape == (1, real.sum()) and (~real).any()  # the padding is gone, nothing else
    assert flat["input_ids"][0].tolist() == padded["input_ids"][real].tolist()
    starts = (flat["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [0, *real.sum(1).cumsum(0)[:-1].tolist()]  # positions restart at every chat


def test_precision_follows_hardware(monkeypatch):
    """Unset, bf16 where a CUDA GPU supports it and fp32 elsewhere (TRL's DPOConfig alone would pick bf16 and refuse
    to start on a CPU); --bf16, --no_bf16 and --fp16 from the user win."""
    from trl import DPOConfig

    from minimind.training import ArgumentParser, DataArguments, ModelArguments, parse_args

    def bf16(argv, gpu):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: gpu)
        namespace, _ = ArgumentParser((ModelArguments, DataArguments, DPOConfig)).parse_known_args(argv)
        return namespace.bf16

    assert (bf16([], gpu=True), bf16([], gpu=False)) == (True, False)
    assert (bf16(["--use_cpu"], gpu=True), bf16(["--no_bf16"], gpu=True), bf16(["--fp16"], gpu=True)) == (
        False,
        False,
        False,
    )
    assert bf16(["--bf16"], gpu=False) is True
    monkeypatch.undo()
    *_, dpo_args = parse_args(["--output_dir", "x"], training_args_class=DPOConfig)
    assert dpo_args.bf16 is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def test_activation_checkpointing_is_opt_in(recwarn):
    """Every script starts with checkpointing off (TRL's DPOConfig would switch it on, through the name that
    transformers 5.24 deprecates); --activation_checkpointing turns it on, also where only the old name exists."""
    from trl import DPOConfig

    from minimind.training import parse_args

    for args_class in (None, DPOConfig):
        kwargs = {"training_args_class": args_class} if args_class else {}
        *_, off = parse_args(["--output_dir", "x"], **kwargs)
        *_, on = parse_args(["--output_dir", "x", "--activation_checkpointing"], **kwargs)
        assert (bool(off.gradient_checkpointing), on.gradient_checkpointing) == (False, True)
    assert not [w for w in recwarn if "gradient_checkpointing" in str(w.message)]


def test_lora_targets_projections_not_router():
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_model
    from minimind.training import LORA_TARGET_MODULES

    model = get_peft_model(
        tiny_model(use_moe=True, num_experts=2), LoraConfig(target_modules=LORA_TARGET_MODULES, task_type="CAUSAL_LM")
    )
    wrapped = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert any(".mlp.experts.1.down_proj" in name for name in wrapped)
    assert any(".self_attn.q_proj" in name for name in wrapped)
    assert not any(name.endswith(".mlp.gate") for name in wrapped)  # the MoE router stays frozen


def test_lora_adapter_equals_merged_model(pretrained, data, tmp_path):
    """LoRA adapter and merged model give same logits."""
    from peft import PeftModel

    out = tmp_path / "lora"
    trainer, _ = load_script("lora").main(
        [
            "--model_name_or_path",
            pretrained[0],
            "--data_path",
            data["sft"],
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--learning_rate",
            "1e-2",
            "--eval_fraction",
            "0",
            "--max_seq_length",
            "96",
            "--merge",
            *FAST,
        ]
    )
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    ids = torch.tensor([[1, 300, 301, 302, 303, 304]])
    base_logits = logits_of(load_remote(pretrained[0]), ids)
    adapted = logits_of(PeftModel.from_pretrained(load_remote(pretrained[0]), str(out)).eval(), ids)
    merged = logits_of(load_remote(out / "merged"), ids)
    assert not torch.allclose(adapted, base_logits, atol=1e-4)  # the adapter learned something
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)


def test_dpo_increases_chosen_rejected_margin(pretrained, data, tmp_path):
    out = tmp_path / "dpo"
    trainer, _ = load_script("dpo").main(
        [
            "--model_name_or_path",
            pretrained[0],
            "--data_path",
            data["dpo"],
            "--output_dir",
            str(out),
            "--max_steps",
            "8",
            "--learning_rate",
            "5e-3",
            "--beta",
            "0.1",
            "--eval_fraction",
            "0",
            "--max_seq_length",
            "96",
            *FAST,
        ]
    )
    margins = logged_losses(trainer, "rewards/margins")
    # Step 1: policy == reference, margin 0. Training on the same pairs must separate them.
    # Each step sees other pairs, so single values are noisy: compare the last three steps.
    assert margins[0] == pytest.approx(0.0, abs=1e-4) and sum(margins[-3:]) / 3 > 0.2, margins
    assert logged_losses(trainer)[-1] < math.log(2) - 0.05
    assert type(load_remote(out)).__name__ == "MiniMindForCausalLM"


def reference_distillation_kl(student, teacher, labels, temperature):
    """T^2 * KL(teacher || student) averaged over the positions whose next label is real, term by term in float64."""
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            if labels[b, t + 1] == -100:
                continue
            p = torch.softmax(teacher[b, t].double() / temperature, -1)
            q = torch.softmax(student[b, t].double() / temperature, -1)
            total += sum(p[v].item() * math.log(p[v].item() / q[v].item()) for v in range(p.shape[0]))
            count += 1
    return temperature**2 * total / count


def test_distillation_kl_term():
    """distillation_kl equals a hand-written T^2 * KL(teacher || student) over the labelled positions (without the
    T^2 factor the value would be 4x smaller at T=2); a position the mask excludes does not count, one it includes
    does."""
    from minimind.training import distillation_kl

    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    # Position t is scored against labels[t + 1]: counted are (0, 1), (0, 2), (0, 3), (1, 0), (1, 1).
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 1, 2, -100, -100]])
    expected = reference_distillation_kl(student, teacher, labels, 2.0)
    assert distillation_kl(student, teacher, labels, 2.0).item() == pytest.approx(expected, rel=1e-6)
    assert expected > 0.1  # far from 0, so a missing or wrong factor cannot hide below the tolerance
    assert distillation_kl(student, teacher, labels, 1.0).item() == pytest.approx(
        reference_distillation_kl(student, teacher, labels, 1.0), rel=1e-6
    )
    assert distillation_kl(teacher, teacher, labels, 2.0).item() == pytest.approx(0.0, abs=1e-6)

    excluded = student.clone()
    excluded[0, 0] += 5.0  # predicts labels[0, 1] = -100
    excluded[1, 4] -= 3.0  # the last position predicts nothing
    assert (
        distillation_kl(excluded, teacher, labels, 2.0).item() == distillation_kl(student, teacher, labels, 2.0).item()
    )
    included = student.clone()
    included[1, 1, 0] += 5.0  # predicts labels[1, 2] = 2
    changed = distillation_kl(included, teacher, labels, 2.0).item()
    assert changed == pytest.approx(reference_distillation_kl(included, teacher, labels, 2.0), rel=1e-6)
    assert abs(changed - expected) > 0.01


def test_distill_from_saved_teacher_lowers_loss(pretrained, data, tmp_path):
    out = tmp_path / "distill"
    trainer, metrics = load_script("distill").main(
        [
            "--teacher_name_or_path",
            pretrained[0],
            "--data_kind",
            "pretrain",
            "--data_path",
            data["pretrain"],
            "--output_dir",
            str(out),
            "--max_steps",
            "10",
            "--learning_rate",
            "3e-3",
            "--eval_fraction",
            "0.1",
            "--temperature",
            "2.0",
            "--alpha",
            "0.5",
            *TINY_MODEL,
            *FAST,
        ]
    )
    losses = logged_losses(trainer)
    assert losses[-1] < losses[0] - 0.3, losses
    assert math.isfinite(metrics["eval_perplexity"])
    assert type(load_remote(out)).__name__ == "MiniMindForCausalLM"


def test_malformed_line_stops_before_training(data, tmp_path, capsys):
    lines = Path(data["pretrain"]).read_text(encoding="utf-8").splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines[:2]) + '{"text": "unterminated\n' + "".join(lines[2:10]), encoding="utf-8")
    out = tmp_path / "out"
    argv = ["--data_path", str(bad), "--output_dir", str(out), "--max_steps", "2", *TINY_MODEL, *FAST]
    with pytest.raises(SystemExit) as exit_info:
        load_script("pretrain").main(argv)
    assert exit_info.value.code == 2
    assert f"{bad}, line 3" in capsys.readouterr().err
    assert not out.exists()  # nothing was trained or saved

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        load_script("sft").main(["--data_path", str(empty), "--output_dir", str(out), *TINY_MODEL, *FAST])
    assert exit_info.value.code == 2 and f"error: {empty}: no valid sft examples" in capsys.readouterr().err


def subprocess_env():
    # One thread per process: the CI machine has 2 cores shared with other jobs.
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def test_resume_after_sigkill_finishes(data, tmp_path):
    """SIGKILL mid-run, then resume finishes all steps."""
    from minimind.training import is_complete_checkpoint, latest_complete_checkpoint

    out = tmp_path / "run"
    max_steps = 80
    # Later flags win: these override FAST's --save_strategy no.
    argv = [
        "--data_path",
        data["pretrain"],
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        *TINY_MODEL,
        *FAST,
        "--save_strategy",
        "steps",
        "--save_steps",
        "5",
        "--save_total_limit",
        "2",
    ]
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "pretrain.py"), *argv],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while latest_complete_checkpoint(out) is None:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert not (out / "model.safetensors").exists()  # killed before the end, not after

    # A checkpoint directory cut off mid-write (no trainer_state.json) must be skipped, not resumed from.
    partial = out / "checkpoint-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    assert not is_complete_checkpoint(partial)

    trainer, _ = load_script("pretrain").main([*argv, "--resume_from_checkpoint", "last"])
    assert trainer.state.global_step == max_steps
    assert type(load_remote(out)).__name__ == "MiniMindForCausalLM"


def test_two_processes_match_one_process(data, tmp_path):
    """1 process x batch 4 and 2 processes (gloo, CPU) x batch 2 see the same global batches (accelerate shards
    each global batch across ranks in order) and average the same gradients, so the loss curves agree up to
    floating-point reassociation: the gradient mean is summed in a different order (all-reduce of two half-batch
    means vs one mean over 4 rows). Measured: <= 2e-6 apart over 5 steps; 1e-4 absolute on a loss of ~8 leaves
    room for other BLAS builds and still catches any real difference (a wrong batch split, per-rank seeds or
    loss scaling change the loss by >1e-2; one process with batch 2 differs by 0.2 here)."""
    common = [
        "--data_path",
        data["pretrain"],
        "--max_steps",
        "5",
        "--learning_rate",
        "3e-3",
        "--eval_fraction",
        "0",
        *TINY_MODEL,
        *FAST,
    ]
    two = tmp_path / "two"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "scripts", "pretrain.py"),
        *common,
        "--output_dir",
        str(two),
        "--per_device_train_batch_size",
        "2",
        "--ddp_backend",
        "gloo",
        "--save_strategy",
        "steps",
        "--save_steps",
        "5",
    ]
    result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Both ranks wrote their RNG state into the staged checkpoint before it was renamed into place.
    from types import SimpleNamespace

    from minimind.training import STAGING_DIR, checkpoint_problems

    assert checkpoint_problems(two / "checkpoint-5", SimpleNamespace(world_size=2)) == []
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(two / "checkpoint-5"))
    assert not (two / STAGING_DIR).exists()
    state = json.loads((two / "trainer_state.json").read_text())
    two_losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]

    one, _ = load_script("pretrain").main(
        [*common, "--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "4"]
    )
    one_losses = logged_losses(one)
    assert len(one_losses) == len(two_losses) == 5
    assert one_losses == pytest.approx(two_losses, abs=1e-4), (one_losses, two_losses)


def test_resume_continues_with_same_losses(data, tmp_path, monkeypatch):
    """Stopping after checkpoint-3 and resuming gives the uninterrupted run's per-step losses: weights, Adam state,
    scheduler, RNG and data order all come back. The resumed run must really start at step 3 (a run that
    ignored the checkpoint would retrain steps 0-5 and, with the same seed, log the same losses)."""
    import shutil

    from minimind import training

    steps_run = []
    original_step = training.CausalLMTrainer.training_step

    def recording_step(self, *args, **kwargs):
        steps_run.append(self.state.global_step)
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(training.CausalLMTrainer, "training_step", recording_step)
    common = [
        "--data_path",
        data["pretrain"],
        "--max_steps",
        "6",
        "--learning_rate",
        "3e-3",
        "--eval_fraction",
        "0",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "2",
        *TINY_MODEL,
        *FAST,
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
    ]
    full, _ = load_script("pretrain").main([*common, "--output_dir", str(tmp_path / "full")])
    assert steps_run == [0, 1, 2, 3, 4, 5]

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed_dir / "checkpoint-3")
    steps_run.clear()
    resumed, _ = load_script("pretrain").main(
        [*common, "--output_dir", str(resumed_dir), "--resume_from_checkpoint", "last"]
    )
    assert steps_run == [3, 4, 5]
    # Measured: bit-identical (same arithmetic, one thread, the same batches in the same order).
    full_losses = [(entry["step"], entry["loss"]) for entry in full.state.log_history if "loss" in entry]
    resumed_losses = [(entry["step"], entry["loss"]) for entry in resumed.state.log_history if "loss" in entry]
    assert [step for step, _ in full_losses] == [1, 2, 3, 4, 5, 6]
    assert resumed_losses == full_losses, (resumed_losses, full_losses)


@pytest.mark.slow
def test_torch_compile_matches_eager_losses(data, tmp_path):
    """The Trainer's own `--torch_compile` on a dense MiniMind: inductor compiles forward and backward on CPU and
    the per-step losses follow eager's (fused elementwise kernels round differently, so not bit for bit)."""
    common = [
        "--data_path",
        data["pretrain"],
        "--max_steps",
        "4",
        "--learning_rate",
        "3e-3",
        "--eval_fraction",
        "0",
        *TINY_MODEL,
        *FAST,
    ]
    eager, _ = load_script("pretrain").main([*common, "--output_dir", str(tmp_path / "eager")])
    compiled, _ = load_script("pretrain").main(
        [*common, "--output_dir", str(tmp_path / "compiled"), "--torch_compile"]
    )
    assert compiled.args.torch_compile and not eager.args.torch_compile
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"  # the step really ran compiled
    assert logged_losses(compiled) == pytest.approx(logged_losses(eager), abs=1e-4)
    assert len(logged_losses(compiled)) == 4


def test_tensorboard_gets_the_logged_losses(tmp_path, data):
    """report_to tensorboard writes the logged losses."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = ["--data_path", data["pretrain"], "--output_dir", str(tmp_path / "run"), "--max_steps", "3"]
    fast = [flag if flag != "none" else "tensorboard" for flag in FAST]  # --report_to tensorboard
    trainer, _ = load_script("pretrain").main([*argv, *TINY_MODEL, *fast])
    (log_dir,) = (tmp_path / "run" / "runs").iterdir()  # the Trainer's default: <output_dir>/runs/<time_host>
    events = EventAccumulator(str(log_dir)).Reload()
    logged = [(scalar.step, scalar.value) for scalar in events.Scalars("train/loss")]
    expected = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    assert [step for step, _ in logged] == [1, 2, 3] == [step for step, _ in expected]
    assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=1e-6)


@pytest.mark.parametrize(
    ("bf16", "native", "warned"),
    [(True, False, True), (True, True, False), (True, None, False), (False, False, False)],
)
def test_bf16_without_cpu_support_warns(bf16, native, warned, monkeypatch, tmp_path, capsys):
    """bf16 on a CPU without it warns before training."""
    from minimind.training import MiniMindTrainingArguments, arguments, recipes

    monkeypatch.setattr(arguments, "cpu_computes_natively", lambda dtype: native)
    training_args = MiniMindTrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=bf16)
    recipes.setup_run(training_args)
    lines = [line for line in capsys.readouterr().out.splitlines() if "--bf16" in line]
    assert len(lines) == (1 if warned else 0)
    assert not warned or lines[0].endswith(
        "WARNING minimind.training: --bf16 on a CPU without native bfloat16 (no avx512_bf16 or amx_bf16): training "
        "runs many times slower than in fp32; drop --bf16 to train in fp32"
    )
