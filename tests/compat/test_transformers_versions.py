"""The model files under whichever transformers is installed: 5.x in the main leg, 5.17 and 4.57 in `.ci/compat.sh`.

Only public APIs both versions share. Everything is loaded back through the Auto classes with
trust_remote_code, i.e. from the copies of the model files inside the checkpoint, as a user would.
The `minimind` package is not imported here: it registers the classes locally, and a registered class is
used instead of the checkpoint's code (in the main leg other test files import it; the 4.57 leg runs alone).
"""

import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from conftest import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A sharp-logit tiny model (std 0.3, so cache bugs change greedy tokens) saved with save_pretrained."""
    path = tmp_path_factory.mktemp("compat-checkpoint")
    model = tiny_model(std=0.3)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def reloaded(checkpoint):
    path, _ = checkpoint
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def prompt():
    return torch.tensor([[1, 5, 17, 42, 8, 64, 3]])


def test_auto_class_reload_uses_checkpoint_code(checkpoint, reloaded):
    path, original = checkpoint
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(config).__name__ == "MiniMindConfig" and config.tie_word_embeddings
    assert type(reloaded).__name__ == "MiniMindForCausalLM"
    if "minimind" not in sys.modules:  # once imported (by other tests), its local registration takes precedence
        assert type(reloaded).__module__.startswith("transformers_modules")  # the checkpoint's copy
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # still tied
    with torch.no_grad():
        torch.testing.assert_close(reloaded(prompt()).logits, original(prompt()).logits)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_cached_generation_equals_uncached(reloaded, cache_implementation):
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    uncached = reloaded.generate(prompt(), use_cache=False, **kwargs)
    cached = reloaded.generate(prompt(), use_cache=True, cache_implementation=cache_implementation, **kwargs)
    assert cached.tolist() == uncached.tolist()
    assert len(set(cached[0, prompt().shape[1] :].tolist())) > 1  # a degenerate repeat would prove little


def test_left_padded_batch_matches_single_prompts(reloaded):
    short = torch.tensor([[1, 9, 33]])
    batch = torch.tensor([[0, 0, 0, 0, 1, 9, 33], prompt()[0].tolist()])
    mask = (torch.arange(7) >= torch.tensor([[4], [0]])).long()
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    together = reloaded.generate(batch, attention_mask=mask, **kwargs)[:, 7:]
    assert together[0].tolist() == reloaded.generate(short, **kwargs)[0, 3:].tolist()
    assert together[1].tolist() == reloaded.generate(prompt(), **kwargs)[0, 7:].tolist()


def training_args(output_dir, **overrides):
    args = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
    )
    # Later 5.x releases renamed gradient checkpointing to activation checkpointing (the old names still work, with
    # a warning). transformers 4.x defaults to reentrant checkpointing, which gives frozen-base LoRA no gradients.
    fields = TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args.update({name: True, f"{name}_kwargs": {"use_reentrant": False}})
    args.update(overrides)
    return TrainingArguments(**args)


def tiny_dataset():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 97, (4, 16), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def test_trainer_steps_with_gradient_checkpointing(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint[0], trust_remote_code=True, dtype=torch.float32)
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=tiny_dataset())
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)


def test_lora_trains_saves_and_reloads(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    path = checkpoint[0]
    base = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    lora = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
        ),
    )
    attention = base.model.layers[0].self_attn
    frozen, adapter = attention.q_proj.base_layer.weight.detach().clone(), attention.q_proj.lora_A["default"]
    adapter_before = adapter.weight.detach().clone()
    Trainer(model=lora, args=training_args(tmp_path / "run"), train_dataset=tiny_dataset()).train()
    assert torch.equal(frozen, attention.q_proj.base_layer.weight)
    assert not torch.equal(adapter_before, adapter.weight)
    lora.save_pretrained(tmp_path / "adapter")

    fresh = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    restored = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    lora.eval()
    with torch.no_grad():
        expected = lora(input_ids=prompt()).logits
        torch.testing.assert_close(restored(input_ids=prompt()).logits, expected)
        torch.testing.assert_close(restored.merge_and_unload()(input_ids=prompt()).logits, expected)


def test_outputs_captured_and_packed_rows_apart(reloaded):
    """The output-capture decorator (check_model_inputs in 4.57, capture_outputs in 5.x) and the mask
    utilities' packed-row detection, through the checkpoint's code."""
    reloaded.set_attn_implementation("eager")
    first, second = [1, 5, 17, 42], [9, 33, 4]
    with torch.no_grad():
        out = reloaded(prompt(), output_hidden_states=True, output_attentions=True)
        plain = reloaded(prompt())
        packed = reloaded(torch.tensor([first + second]), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))
        alone = reloaded(torch.tensor([second]))
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(1, 4, 7))
    assert plain.hidden_states is None and plain.attentions is None
    torch.testing.assert_close(packed.logits[0, 4:], alone.logits[0], atol=1e-5, rtol=1e-5)


def test_moe_records_router_logits_and_aux_loss(tmp_path):
    path = tmp_path / "moe"
    tiny_model(std=0.2, use_moe=True, num_experts=4, num_experts_per_tok=2).save_pretrained(path)
    moe = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        out = moe(prompt(), labels=prompt())
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (7, 4)
    lm_only = moe.loss_function(logits=out.logits, labels=prompt(), vocab_size=97)
    torch.testing.assert_close(out.loss, lm_only + moe.config.router_aux_loss_coef * out.aux_loss)
