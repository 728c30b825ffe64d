"""The transformers contract beyond plain forward/generate: static cache and torch.compile, padding-free
packing, custom 4-D masks, output tuples and capture, and the experts interface. Each test sets MiniMind
against a reference: its own dynamic-cache / padded / unpacked run, or transformers' Qwen3."""

import gc
import weakref

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening, DynamicCache, StaticCache

import modeling_minimind
from conftest import tiny_config, tiny_model
from minimind.export import to_qwen3_model
from modeling_minimind import MiniMindForCausalLM

V5 = int(transformers.__version__.split(".")[0]) >= 5
EXPERTS_IMPLEMENTATIONS = ["eager", "batched_mm", "grouped_mm"] if V5 else ["eager"]


def moe_model(**overrides):
    return tiny_model(std=0.2, use_moe=True, num_experts=4, num_experts_per_tok=2, **overrides)


# ------------------------------------------------------------------------------------------------------
# Static cache and torch.compile
# ------------------------------------------------------------------------------------------------------


def test_compile_and_experts_support_flags():
    """Like Qwen3 / Qwen3-MoE: both compile with fullgraph=True; a dense model has no experts, so asking it for
    an experts kernel fails as it does for dense Qwen3 instead of silently running nothing."""
    dense, moe = tiny_model(), moe_model()
    assert dense._can_compile_fullgraph and moe._can_compile_fullgraph
    assert moe.config._experts_implementation == "eager"
    assert not dense._can_set_experts_implementation()
    if V5:
        assert type(dense)._can_set_experts_implementation()  # what transformers asks the class: MoE configs can
        qwen3 = to_qwen3_model(tiny_model())
        for model in (dense, qwen3):
            with pytest.raises(ValueError, match=r"does not support setting experts implementation"):
                model.set_experts_implementation("grouped_mm")
            model.set_experts_implementation("batched_mm")
            assert model.config._experts_implementation == "eager"
        moe.set_experts_implementation("batched_mm")
        assert moe.config._experts_implementation == "batched_mm"


@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_static_cache_generate_equals_dynamic(use_moe):
    """Static cache generate equals dynamic also from inputs_embeds."""
    model = moe_model() if use_moe else tiny_model(std=0.3)
    ids = torch.tensor([[5, 17, 42, 8, 64, 3], [9, 4, 7, 1, 2, 33]])
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(dynamic, static)
    assert len(set(map(tuple, dynamic[:, 6:].tolist()))) > 1  # sensitive: the rows decode differently
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, cache_implementation="static", **kwargs)
    assert torch.equal(from_embeds[:, -8:], dynamic[:, 6:])


def _decode_with_compiled_step(model, prompt, steps, compiled):
    """Prefill eagerly into a StaticCache, then run `steps` one-token steps through `compiled`; returns
    the greedy tokens and the last step's logits."""
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        logits = model(prompt, cache=cache, use_cache=True).logits[:, -1]
        tokens = []
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token.item())
            logits = compiled(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return tokens, logits


@pytest.mark.parametrize(
    "variant", ["dense", "moe", "moe-shared", "moe-batched_mm"] if V5 else ["dense", "moe", "moe-shared"]
)
def test_compiled_decode_no_break_or_recompile(variant):
    """fullgraph=True fails on any graph break; error_on_recompile fails if the second, shorter prompt
    (or a later step) needs a new graph. The 'eager' backend traces exactly as inductor would, without
    inductor's minutes of C++ compilation on a CPU. The default MoE dispatch has no host sync when compiled."""
    model = tiny_model(std=0.3) if variant == "dense" else moe_model(n_shared_experts=int(variant == "moe-shared"))
    if variant == "moe-batched_mm":
        model.set_experts_implementation("batched_mm")
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="eager", dynamic=False)
    first, second = torch.tensor([[5, 17, 42, 8, 64, 3]]), torch.tensor([[9, 4, 7]])
    tokens, logits = _decode_with_compiled_step(model, first, 4, compiled)
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens_2, logits_2 = _decode_with_compiled_step(model, second, 4, compiled)
    assert (tokens, tokens_2) == (
        _decode_with_compiled_step(model, first, 4, model.forward)[0],
        _decode_with_compiled_step(model, second, 4, model.forward)[0],
    )
    eager_logits = _decode_with_compiled_step(model, second, 4, model.forward)[1]
    torch.testing.assert_close(logits_2, eager_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_inductor_decode_step_equals_eager():
    """The real thing users run on a GPU: inductor (about 45 s of C++ compilation on 2 CPU cores)."""
    model = tiny_model(std=0.3)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
    first, second = torch.tensor([[5, 17, 42, 8, 64, 3]]), torch.tensor([[9, 4, 7]])
    tokens = _decode_with_compiled_step(model, first, 3, compiled)[0]
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens_2, logits_2 = _decode_with_compiled_step(model, second, 3, compiled)
    eager_2 = _decode_with_compiled_step(model, second, 3, model.forward)
    assert tokens == _decode_with_compiled_step(model, first, 3, model.forward)[0] and tokens_2 == eager_2[0]
    torch.testing.assert_close(logits_2, eager_2[1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Padding-free packing and custom 4-D masks
# ------------------------------------------------------------------------------------------------------

SEQUENCES = [[5, 17, 42, 8, 64, 3, 11, 12, 13, 14], [9, 4, 7, 1, 2, 33, 40], [21, 22, 23, 24, 25, 26, 27, 28, 29]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_rows_equal_padded_batch(attn):
    """DataCollatorWithFlattening's packed row (26 tokens, longer than max_position_embeddings=16) gives
    the padded batch's per-token logits and loss: positions restart, attention stays inside each sequence."""
    model = tiny_model(std=0.2, max_position_embeddings=16, attn_implementation=attn)
    packed = DataCollatorWithFlattening()([{"input_ids": s, "labels": s} for s in SEQUENCES])
    assert packed["input_ids"].shape == (1, 26) and "attention_mask" not in packed
    longest = max(map(len, SEQUENCES))
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in SEQUENCES])
    mask = (torch.arange(longest)[None] < torch.tensor([len(s) for s in SEQUENCES])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, labels=labels)
        flat = model(**packed)
    starts = [0, 10, 17, 26]
    for row, (begin, end) in enumerate(zip(starts, starts[1:])):
        torch.testing.assert_close(flat.logits[0, begin:end], padded.logits[row, : end - begin], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat.loss, padded.loss, atol=1e-6, rtol=1e-6)


def _block_causal_mask(lengths):
    total = sum(lengths)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return (causal & (segment[:, None] == segment[None, :]))[None, None]  # [1, 1, T, T], True = attend


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["bool", "additive"])
def test_block_diagonal_mask_equals_separate(attn, form):
    """Block diagonal 4-D mask equals the sequences run separately."""
    model = tiny_model(std=0.2, attn_implementation=attn)
    lengths = [len(s) for s in SEQUENCES]
    mask = _block_causal_mask(lengths)
    if form == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    ids = torch.tensor([sum(SEQUENCES, [])])
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        together = model(ids, attention_mask=mask, position_ids=positions).logits[0]
        apart = torch.cat([model(torch.tensor([s])).logits[0] for s in SEQUENCES])
    torch.testing.assert_close(together, apart, atol=1e-5, rtol=1e-5)


def test_tree_mask_scores_branches_separately():
    """A prefix, then two candidate continuations that each see the prefix but not each other."""
    model = tiny_model(std=0.2, attn_implementation="eager")
    prefix, branch_a, branch_b = [5, 17, 42], [8, 64], [9, 4]
    ids = torch.tensor([prefix + branch_a + branch_b])
    mask = torch.zeros(1, 1, 7, 7, dtype=torch.bool)
    mask[0, 0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    for start in (3, 5):
        mask[0, 0, start : start + 2, :3] = True
        mask[0, 0, start : start + 2, start : start + 2] = torch.ones(2, 2, dtype=torch.bool).tril()
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    with torch.no_grad():
        tree = model(ids, attention_mask=mask, position_ids=positions).logits[0]
        a = model(torch.tensor([prefix + branch_a])).logits[0]
        b = model(torch.tensor([prefix + branch_b])).logits[0]
    torch.testing.assert_close(tree[:5], a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[5:], b[3:], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Outputs: tuples, the cache keyword, captured hidden states / attentions / router logits
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_return_dict_false_gives_field_tuple(use_moe):
    """return_dict=False gives the dataclass fields in order."""
    model = moe_model() if use_moe else tiny_model(std=0.2)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(labels=ids, use_cache=True, output_hidden_states=True, output_attentions=True)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        as_dict = model(ids, **kwargs)
        as_tuple = model(ids, return_dict=False, **kwargs)
    fields = as_dict.to_tuple()
    assert len(as_tuple) == len(fields) == (7 if use_moe else 5)
    for ours, expected in zip(as_tuple, fields):
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(ours, expected)
        elif isinstance(expected, tuple):
            assert len(ours) == len(expected)
            for a, b in zip(ours, expected):
                torch.testing.assert_close(a, b)
        else:
            assert type(ours) is type(expected)


def test_older_cache_keyword_like_qwen3():
    """Older cache keyword round trips like Qwen3."""
    model = tiny_model(std=0.2)
    theirs = to_qwen3_model(model)
    ids = torch.tensor([[5, 17, 42, 8]])
    ours_cache, their_cache = DynamicCache(config=model.config), DynamicCache(config=theirs.config)
    with torch.no_grad():
        ours = model(ids, past_key_values=ours_cache, use_cache=True)
        reference = theirs(ids, past_key_values=their_cache, use_cache=True)
    assert list(ours.keys()) == list(reference.keys())
    assert ours.past_key_values is ours_cache and ours_cache.get_seq_length() == 4
    assert reference.past_key_values is their_cache


@pytest.mark.skipif(not V5, reason="selecting hidden states by index is a transformers 5 feature")
def test_chosen_hidden_states_equal_qwen3():
    """Hidden states of chosen layers equal Qwen3."""
    model = tiny_model(std=0.2, num_hidden_layers=3)
    theirs = to_qwen3_model(model)
    ids = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        everything = model(ids, output_hidden_states=True).hidden_states
        chosen = model(ids, output_hidden_states=[1, -1]).hidden_states
        reference = theirs(ids, output_hidden_states=[1, -1]).hidden_states
    assert len(everything) == 4
    # The same selection as Qwen3 under the installed release (5.24: every index, unchosen ones None).
    assert [h is None for h in chosen] == [h is None for h in reference]
    picked = [i for i, h in enumerate(chosen) if h is not None]
    assert picked and (len(chosen) != 4 or picked == [1, 3])
    for index in picked:
        torch.testing.assert_close(chosen[index], reference[index], atol=1e-5, rtol=1e-5)
        if len(chosen) == 4:
            torch.testing.assert_close(chosen[index], everything[index])


def test_attentions_kept_only_when_asked(monkeypatch):
    """Attention probabilities are not kept unless asked."""
    probs = []

    def recording_eager(*args, **kwargs):
        out, weights = eager(*args, **kwargs)
        probs.append(weakref.ref(weights))
        return out, weights

    eager = modeling_minimind.eager_attention_forward
    monkeypatch.setattr(modeling_minimind, "eager_attention_forward", recording_eager)
    model = tiny_model(attn_implementation="eager")
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        out = model(ids)
        gc.collect()
        assert out.attentions is None and len(probs) == 2 and all(ref() is None for ref in probs)
        asked = model(ids, output_attentions=True)
    assert len(asked.attentions) == 2 and asked.attentions[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(asked.attentions[0].sum(-1), torch.ones(2, 4, 6))


def test_router_logits_recorded_like_qwen3():
    """Router logits are recorded like Qwen3-MoE."""
    model = moe_model(num_hidden_layers=3, mlp_only_layers=[1])
    theirs = to_qwen3_model(model)
    ids = torch.tensor([[5, 17, 42, 8, 64, 3]])
    with torch.no_grad():
        ours = model(ids, output_router_logits=True).router_logits
        reference = theirs(ids, output_router_logits=True).router_logits
    assert len(ours) == len(reference) == 2
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# The experts interface
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", EXPERTS_IMPLEMENTATIONS)
def test_experts_implementations_agree(implementation, tmp_path):
    """Experts implementations give the default dispatch outputs and gradients."""
    reference = moe_model(router_aux_loss_coef=0.01)
    reference.save_pretrained(tmp_path)
    kwargs = {"experts_implementation": implementation} if V5 else {}
    model = MiniMindForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **kwargs)
    assert model.config._experts_implementation == implementation if V5 else True
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (reference, model):
        m.train()
        out = m(ids, labels=ids)
        out.loss.backward()
        losses.append((out.logits, out.loss))
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(losses[1][1], losses[0][1], atol=1e-6, rtol=1e-6)
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    assert model.model.layers[0].mlp.experts[3].up_proj.weight.grad.abs().sum() > 0


def test_default_and_unknown_experts_impl():
    """Default experts implementation is MiniMind dispatch and unknown ones are refused."""
    model = moe_model()
    assert model.config._experts_implementation == "eager"
    if V5:
        with pytest.raises(ValueError, match="experts_implementation"):
            model.set_experts_implementation("no_such_kernel")


def test_tiny_config_used_here_is_really_moe():
    config = tiny_config(use_moe=True, num_experts=4, num_experts_per_tok=2)
    assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


# ------------------------------------------------------------------------------------------------------
# Inputs generate() and from_pretrained() would otherwise take silently or fail on deep inside
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_length", [3, 5], ids=["short", "long"])
def test_generate_refuses_wrong_length_mask(mask_length):
    """Generate refuses a mask whose length is not the prompts."""
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(
        ValueError,
        match=rf"attention_mask has shape \[1, {mask_length}\] but the prompt is "
        r"\[1, 4\]\. Fix: pass one mask column per prompt token",
    ):
        model.generate(ids, attention_mask=torch.ones(1, mask_length, dtype=torch.long), max_new_tokens=2)
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match=r"the prompt is \[1, 4\]"):
        model.generate(
            inputs_embeds=embeds, attention_mask=torch.ones(1, mask_length, dtype=torch.long), max_new_tokens=2
        )
    # the right mask still generates, and a padded one equals the unpadded prompt's tokens
    right = model.generate(ids, attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, do_sample=False)
    padded = model.generate(
        torch.tensor([[0, 5, 6, 7, 8]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1]]),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
    )
    assert right[0, 4:].tolist() == padded[0, 5:].tolist()


def test_forward_refuses_short_position_ids():
    """Forward refuses position ids that do not cover the input."""
    model = tiny_model()
    with pytest.raises(
        ValueError,
        match=r"position_ids cover 3 tokens but the input has 4\. Fix: pass one "
        r"position per input token",
    ):
        model(torch.tensor([[5, 6, 7, 8]]), position_ids=torch.arange(3)[None])


@pytest.mark.parametrize("keep_bytes", [5, 100, "half"])
def test_truncated_weights_file_is_named(tmp_path, keep_bytes):
    """from_pretrained names a truncated weights file."""
    from transformers import AutoModelForCausalLM

    tiny_model().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    full = weights.stat().st_size
    assert modeling_minimind.safetensors_problem(weights) is None
    with open(weights, "r+b") as file:
        file.truncate(full // 2 if keep_bytes == "half" else keep_bytes)
    problem = modeling_minimind.safetensors_problem(weights)
    assert problem is not None
    with pytest.raises(OSError, match="the safetensors file is incomplete or damaged") as raised:
        AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert str(raised.value).startswith(f"{weights} ({problem})")
    if keep_bytes == "half":
        assert problem == f"{full // 2} bytes where its header promises {full}"
