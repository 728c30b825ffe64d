"""The model as a transformers citizen: Auto classes with remote code offline, and the Trainer."""

import json
import math
import os
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Trainer, TrainingArguments

from conftest import tiny_model


def _saved_keys(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("tied", [True, False])
def test_auto_class_roundtrip_remote_code(tmp_path, tied):
    """Save and reload through auto classes with remote code."""
    model = tiny_model(
        std=0.1,
        tie_word_embeddings=tied,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
    )
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {
        "config.json",
        "model.safetensors",
        "configuration_minimind.py",
        "modeling_minimind.py",
        "generation_config.json",
    } <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_minimind.MiniMindConfig",
        "AutoModel": "modeling_minimind.MiniMindModel",
        "AutoModelForCausalLM": "modeling_minimind.MiniMindForCausalLM",
        "AutoModelForSequenceClassification": "modeling_minimind.MiniMindForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_minimind.MiniMindForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_minimind.MiniMindForQuestionAnswering",
    }
    assert ("lm_head.weight" in _saved_keys(tmp_path)) == (not tied)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "MiniMindForCausalLM"
    if "minimind" not in sys.modules:  # importing the package registers local classes, which transformers prefers
        assert type(loaded).__module__.startswith("transformers_modules.")  # really the copied remote code
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    fresh_inv_freq = model.model.rotary_emb.inv_freq
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, fresh_inv_freq, atol=0, rtol=0)
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=1e-6)
    if not tied:
        torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)

    # A remote-loaded model re-saves with its code; AutoConfig and AutoModel read the same directory.
    loaded.save_pretrained(tmp_path / "again")
    assert {"configuration_minimind.py", "modeling_minimind.py"} <= set(os.listdir(tmp_path / "again"))
    assert AutoConfig.from_pretrained(tmp_path, trust_remote_code=True).model_type == "minimind"
    backbone = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    assert type(backbone).__name__ == "MiniMindModel"


def test_package_registers_auto_classes(tmp_path):
    """Package registers auto classes without remote code."""
    import minimind  # noqa: F401  (the import registers the Auto classes)
    from configuration_minimind import MiniMindConfig
    from modeling_minimind import MiniMindForCausalLM

    built = AutoModelForCausalLM.from_config(
        MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    )
    assert type(built) is MiniMindForCausalLM
    tiny_model().save_pretrained(tmp_path)
    local = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False)
    assert type(local) is MiniMindForCausalLM


def test_remote_code_needs_no_repo_on_sys_path(tmp_path):
    """The checkpoint alone (code copied in) loads in a fresh interpreter that has never imported the
    package, from any folder, and generates exactly the in-process model's tokens."""
    import subprocess

    model = tiny_model(std=0.3)
    model.save_pretrained(tmp_path / "ckpt")
    prompt = [[1, 2, 3, 40, 7]]
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True)\n"
        "assert 'minimind' not in sys.modules and 'modeling_minimind' not in sys.modules\n"
        "print(type(m).__module__.split('.')[0])\n"
        f"print(m.generate(torch.tensor({prompt}), max_new_tokens=8, do_sample=False)[0].tolist())\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    module_root, tokens = result.stdout.strip().splitlines()[-2:]
    assert module_root == "transformers_modules"
    expected = model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False)[0].tolist()
    assert json.loads(tokens) == expected and len(set(expected[5:])) > 1


class _RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 97, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, batch, accumulation, checkpointing):
    model = tiny_model(seed=0).train()
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        gradient_checkpointing=checkpointing,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_RandomTokens())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    changed = (model.model.layers[0].self_attn.q_proj.weight - before).abs().max().item()
    return losses, changed


def test_trainer_accumulation_and_checkpoints(tmp_path):
    """Trainer gradient accumulation and checkpointing."""
    losses_ga, changed = _train(tmp_path / "ga", batch=2, accumulation=2, checkpointing=True)
    losses_plain, _ = _train(tmp_path / "plain", batch=4, accumulation=1, checkpointing=False)
    assert len(losses_ga) == 2 and all(math.isfinite(v) for v in losses_ga)
    assert changed > 0
    # Same four samples at the same initial weights: the logged loss must be on the same scale (a model that
    # ignored num_items_in_batch would log about accumulation x this).
    assert losses_ga[0] == pytest.approx(losses_plain[0], rel=0.02)
    assert losses_ga[0] == pytest.approx(math.log(97), rel=0.1)
