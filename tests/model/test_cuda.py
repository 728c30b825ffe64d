"""The model on a CUDA GPU: what the CPU suite cannot reach (CUDA kernels, bf16 weights, the one-token decode
step that skips the token-id check off the CPU, host syncs, torch.compile of a static-cache decode,
flash-attention 2).

Skipped without a GPU. `MINIMIND_TEST_DEVICE=cpu` runs them on the CPU instead, to check the tests themselves
before a GPU is at hand; `scripts/gpu_check.sh` runs them on one.
"""

import os
import warnings

import pytest
import torch

from conftest import tiny_model
from minimind.export import to_qwen3_model

DEVICE = os.environ.get("MINIMIND_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs a CUDA GPU (MINIMIND_TEST_DEVICE=cpu runs these tests on the CPU)"
)
ON_CUDA = DEVICE is not None and DEVICE.startswith("cuda")
MOE = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[1])


def ids_on_device(batch, length, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def relative_error(actual, expected):
    """Largest absolute difference as a share of the reference's largest magnitude: the measure that suits bf16,
    whose rounding error scales with the values."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# ------------------------------------------------------------------------------------------------------
# Kernels and dtypes
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("overrides", [{}, MOE], ids=["dense", "moe"])
def test_fp32_logits_equal_cpu(attn, overrides):
    """fp32 logits on device equal CPU logits."""
    model = tiny_model(std=0.1, attn_implementation=attn, **overrides)
    ids = ids_on_device(2, 24)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    with torch.no_grad():
        expected = model(ids.cpu(), attention_mask=mask.cpu()).logits
        actual = model.to(DEVICE)(ids, attention_mask=mask).logits
    torch.testing.assert_close(actual[1].cpu(), expected[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(actual[0, 5:].cpu(), expected[0, 5:], atol=1e-4, rtol=1e-4)


def test_bf16_eager_and_sdpa_near_fp32():
    # Dense only: in bf16 a near-tie router picks another expert for some token, which no tolerance can absorb.
    # The MoE model in bf16 is held to Qwen3-MoE in bf16 below instead.
    """Bf16 weights eager and sdpa stay near fp32."""
    reference = tiny_model(std=0.1)
    ids = ids_on_device(2, 32)
    with torch.no_grad():
        expected = reference(ids.cpu()).logits
        errors = {}
        for attn in ("eager", "sdpa"):
            model = tiny_model(std=0.1, attn_implementation=attn).to(DEVICE, torch.bfloat16)
            logits = model(ids).logits
            assert logits.dtype == torch.bfloat16
            errors[attn] = relative_error(logits.cpu(), expected)
    # bf16 keeps 8 significant bits (0.4% per rounding); two layers of them stay within a few percent.
    assert max(errors.values()) < 0.03, errors


def test_flash_attention_2_matches_sdpa():
    if not ON_CUDA:
        pytest.skip("flash_attention_2 needs a CUDA GPU")
    pytest.importorskip("flash_attn")
    fa = tiny_model(std=0.1, attn_implementation="flash_attention_2").to(DEVICE, torch.bfloat16)
    sd = tiny_model(std=0.1, attn_implementation="sdpa").to(DEVICE, torch.bfloat16)
    ids = ids_on_device(2, 16)
    with torch.no_grad():
        assert relative_error(fa(ids).logits, sd(ids).logits) < 0.02


def test_flash_varlen_packed_equals_separate():
    """Padding-free rows (restarting position_ids, no mask): flash-attention 2 takes its varlen path from the
    positions and keeps each sequence to itself."""
    if not ON_CUDA:
        pytest.skip("flash_attention_2 needs a CUDA GPU")
    pytest.importorskip("flash_attn")
    model = tiny_model(std=0.1, attn_implementation="flash_attention_2").to(DEVICE, torch.bfloat16)
    sequences = [ids_on_device(1, 10, seed=1), ids_on_device(1, 7, seed=2)]
    positions = torch.cat([torch.arange(10), torch.arange(7)])[None].to(DEVICE)
    with torch.no_grad():
        packed = model(torch.cat(sequences, dim=1), position_ids=positions).logits[0]
        apart = torch.cat([model(s).logits[0] for s in sequences])
    assert relative_error(packed, apart) < 0.02


# ------------------------------------------------------------------------------------------------------
# Parity with transformers' Qwen3 / Qwen3-MoE on the device
# ------------------------------------------------------------------------------------------------------


def qwen3_pair(overrides):
    """Ours and transformers' Qwen3 / Qwen3-MoE with the same weights, both on the device. Qwen3-MoE runs its
    eager experts: the same per-expert matmuls as ours (its default grouped_mm kernel rounds differently in bf16)."""
    ours = tiny_model(std=0.1, **overrides)
    theirs = to_qwen3_model(ours)
    if overrides:
        theirs.set_experts_implementation("eager")
    return ours.to(DEVICE), theirs.to(DEVICE).eval()


@pytest.mark.parametrize("overrides", [{}, MOE], ids=["dense", "moe"])
def test_fp32_logits_and_loss_equal_qwen3(overrides):
    """fp32 logits and loss equal Qwen3 on device."""
    ours, theirs = qwen3_pair(overrides)
    ids = ids_on_device(2, 24)
    extra = {"output_router_logits": True} if overrides else {}
    with torch.no_grad():
        a = ours(ids, labels=ids)
        b = theirs(ids, labels=ids, **extra)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{}, MOE], ids=["dense", "moe"])
def test_bf16_logits_equal_qwen3(overrides):
    """bf16 weights logits equal Qwen3 on device."""
    ours, theirs = qwen3_pair(overrides)
    ours.bfloat16(), theirs.bfloat16()
    ids = ids_on_device(2, 32)
    with torch.no_grad():
        assert relative_error(ours(ids).logits, theirs(ids).logits) < 0.01


@pytest.mark.parametrize("overrides", [{}, MOE], ids=["dense", "moe"])
def test_bf16_training_step_matches_qwen3(overrides):
    """bf16 autocast training step matches Qwen3 on device."""
    ours, theirs = qwen3_pair(overrides)
    ours.train(), theirs.train()
    ids = ids_on_device(2, 32)
    extra = {"output_router_logits": True} if overrides else {}
    losses = []
    for model, kwargs in ((ours, {}), (theirs, extra)):
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids, **kwargs).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    theirs_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        if ".experts." in name:  # fused into gate_up_proj / down_proj on their side; the loss covers them
            continue
        other = theirs_params[name].grad
        cosine = torch.nn.functional.cosine_similarity(param.grad.flatten(), other.flatten(), dim=0).item()
        assert cosine > 0.999, (name, cosine)


# ------------------------------------------------------------------------------------------------------
# Decoding on the device
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("overrides", [{}, MOE], ids=["dense", "moe"])
def test_cached_greedy_equals_uncached(cache, overrides):
    # The one-token cached steps are where the token-id check is skipped off the CPU; the tokens must not move.
    """Cached greedy decode equals uncached on device."""
    model = tiny_model(std=0.2, **overrides).to(DEVICE)
    prompt = ids_on_device(2, 6)
    kwargs = dict(max_new_tokens=10, do_sample=False, disable_compile=True, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, cache_implementation=cache, **kwargs)
        uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 6:].tolist())) > 1  # sharp logits: a dropped cache would change the tokens


def test_out_of_range_prompt_ids_raise():
    """Out of range prompt ids raise on device."""
    model = tiny_model().to(DEVICE)
    with pytest.raises(ValueError, match=r"token id\(s\) \[97, 500\] outside the vocabulary \[0, 97\)"):
        model(torch.tensor([[1, 97, 500]], device=DEVICE))


def test_decode_syncs_no_more_than_qwen3():
    """Cached decode step syncs the host no more than Qwen3."""
    if not ON_CUDA:
        pytest.skip("host syncs are counted by CUDA's sync debug mode")
    ours = tiny_model(std=0.1)
    theirs = to_qwen3_model(ours).to(DEVICE).eval()
    ours.to(DEVICE)
    prompt = ids_on_device(1, 8)
    syncs = {}
    for name, model in (("ours", ours), ("qwen3", theirs)):
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            step = out.logits[:, -1:].argmax(-1)  # stays on the device
            cache = out.cache if "cache" in out else out.past_key_values
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(step, past_key_values=cache, use_cache=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        syncs[name] = sum("synchronizing" in str(w.message) for w in caught)
    assert syncs["ours"] <= syncs["qwen3"], syncs


def test_compiled_static_equals_dynamic():
    # generate compiles the forward by itself for a static cache on an accelerator; the CPU opts in explicitly.
    """Compiled static cache generate equals dynamic cache."""
    from transformers import CompileConfig

    model = tiny_model(std=0.2).to(DEVICE)
    prompt = ids_on_device(1, 6)
    compile_config = CompileConfig(fullgraph=False, dynamic=False)
    compile_config._compile_all_devices = True
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        dynamic = model.generate(prompt, disable_compile=True, **kwargs)
        compiled = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert hasattr(model, "_compiled_call")  # generate took the compiled path (transformers' own attribute)
    assert torch.equal(compiled, dynamic)
