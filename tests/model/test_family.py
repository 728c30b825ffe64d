"""MiniMind as a member of transformers' Qwen3 family: the task heads, the output classes, label smoothing in the
Trainer, each against Qwen3 / Qwen3-MoE holding the same weights."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Trainer,
    TrainingArguments,
)

from conftest import tiny_model
from minimind.export import to_qwen3_model
from modeling_minimind import MiniMindForCausalLM

IDS = torch.tensor([[0, 0, 5, 17, 42, 8, 64, 3], [9, 4, 7, 1, 2, 33, 40, 11]])  # row 0 left-padded (pad id 0)
MASK = (IDS != 0).long()
MOE = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
HEADS = {
    "sequence": (AutoModelForSequenceClassification, "ForSequenceClassification", "score"),
    "token": (AutoModelForTokenClassification, "ForTokenClassification", "score"),
    "qa": (AutoModelForQuestionAnswering, "ForQuestionAnswering", "qa_outputs"),
}


def qwen3_twin(model):
    """(native causal LM with `model`'s weights, its module name: Qwen3 or Qwen3Moe)."""
    native = to_qwen3_model(model).eval()
    return native, type(native).__name__.removesuffix("ForCausalLM")


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_task_heads_load_lm_and_equal_qwen3(tmp_path, kind, moe):
    """Any saved MiniMind checkpoint opens as each head through the Auto class with remote code; the backbone
    is the checkpoint's (only the new head is initialised) and the logits are Qwen3's head on the same weights."""
    source = tiny_model(std=0.2, **(MOE if moe else {}))
    source.save_pretrained(tmp_path)
    auto_class, suffix, head_name = HEADS[kind]
    labels = {"num_labels": 3} if kind != "qa" else {}
    head = auto_class.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32, **labels).eval()
    assert type(head).__name__ == f"MiniMind{suffix}"
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(head.model.state_dict()[name], tensor), name

    native, family = qwen3_twin(source)
    twin = getattr(transformers, f"{family}{suffix}")(native.config.__class__(**{**native.config.to_dict(), **labels}))
    getattr(twin, twin.base_model_prefix).load_state_dict(native.model.state_dict())
    getattr(twin, head_name).load_state_dict(getattr(head, head_name).state_dict())
    with torch.no_grad():
        ours, theirs = head(IDS, attention_mask=MASK), twin.eval()(IDS, attention_mask=MASK)
    fields = ("start_logits", "end_logits") if kind == "qa" else ("logits",)
    for field in fields:
        torch.testing.assert_close(getattr(ours, field), getattr(theirs, field), atol=1e-5, rtol=1e-5)
    if kind == "sequence":  # pooled at each row's last real token
        assert ours.logits.shape == (2, 3) and ours.logits.std() > 0.01


def test_auto_map_names_every_head(tmp_path):
    """Saved config names every head in auto_map."""
    tiny_model().save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    for _, suffix, _ in HEADS.values():
        assert auto_map[f"AutoModel{suffix}"] == f"modeling_minimind.MiniMind{suffix}"


def test_package_registers_every_head(tmp_path):
    """Package registers every head without remote code."""
    import minimind
    import modeling_minimind

    tiny_model().save_pretrained(tmp_path)
    for auto_class, suffix, _ in HEADS.values():
        head = auto_class.from_pretrained(tmp_path, trust_remote_code=False)
        assert type(head) is getattr(modeling_minimind, f"MiniMind{suffix}") is getattr(minimind, f"MiniMind{suffix}")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_outputs_are_the_classes_qwen3_returns(moe):
    model = tiny_model(**(MOE if moe else {}))
    native, _ = qwen3_twin(model)
    with torch.no_grad():
        for ours, theirs in ((model, native), (model.model, native.model)):
            assert type(ours(IDS)) is type(theirs(IDS))


def _smoothed_loss(model, labels):
    args = TrainingArguments(output_dir="unused", label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    with torch.no_grad():
        return trainer.compute_loss(model, {"input_ids": IDS, "attention_mask": MASK, "labels": labels}).item()


LABELS = torch.where(MASK.bool(), IDS, -100)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_label_smoothing_gives_qwen3_loss(moe):
    """The Trainer shifts labels for label smoothing only for causal LMs it knows by name; ours is among them."""
    model = tiny_model(std=0.2, **(MOE if moe else {}))
    native, _ = qwen3_twin(model)
    ours, theirs = _smoothed_loss(model, LABELS), _smoothed_loss(native, LABELS)
    assert ours == pytest.approx(theirs, abs=1e-5)
    plain = model(IDS, attention_mask=MASK, labels=LABELS).loss.item()
    assert abs(ours - plain) > 0.01  # the smoothing is applied, not the plain loss


def test_label_smoothing_as_remote_code(tmp_path):
    """A user's own Trainer on AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True), in a process
    where neither `minimind` nor the repository's model files are importable."""
    model = tiny_model(std=0.2)
    model.save_pretrained(tmp_path / "model")
    native, _ = qwen3_twin(model)
    expected = _smoothed_loss(native, LABELS)
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        assert "minimind" not in sys.modules
        ids = torch.tensor({IDS.tolist()}); mask = (ids != 0).long()
        args = TrainingArguments(output_dir={str(tmp_path / "out")!r}, label_smoothing_factor=0.1, report_to=[],
                                 use_cpu=True)
        inputs = {{"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}}
        with torch.no_grad():
            print(Trainer(model=model, args=args).compute_loss(model, inputs).item())
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(expected, abs=1e-5)


def test_forward_takes_the_current_cache_keyword():
    """5.24 renamed `past_key_values` to `cache`; the forwards follow the installed release's name."""
    import inspect

    current = (
        "cache" if "cache" in transformers.modeling_outputs.BaseModelOutputWithPast.__dataclass_fields__ else None
    )
    parameters = inspect.signature(MiniMindForCausalLM.forward).parameters
    assert "cache" in parameters and "past_key_values" not in parameters
    if current:
        qwen3 = inspect.signature(transformers.Qwen3ForCausalLM.forward).parameters
        assert "cache" in qwen3 and "past_key_values" not in qwen3
