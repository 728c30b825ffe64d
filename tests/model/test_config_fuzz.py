"""Config fuzzing with a fixed seed: every drawn config either builds a model that runs a forward with
finite logits, or is refused with `ValueError("MiniMindConfig.<field>: <problem>. Fix: <fix>.")`;
never a TypeError, KeyError or a silently wrong model."""

import math
import random
import re

import pytest
import torch

from configuration_minimind import MiniMindConfig
from modeling_minimind import MiniMindForCausalLM

BAD = ["x", "1e-6", None, -1, 0, math.nan, math.inf, [1], {"a": 1}, True, 2.5]
CHOICES = {
    "vocab_size": [32, 64, *BAD],
    "hidden_size": [16, 32, 24, *BAD],
    "num_hidden_layers": [1, 2, *BAD],
    "num_attention_heads": [2, 4, 3, *BAD],
    "num_key_value_heads": [1, 2, 4, *BAD],
    "head_dim": [None, 8, 6, 7, *BAD],
    "intermediate_size": [None, 32, *BAD],
    "max_position_embeddings": [64, *BAD],
    "rms_norm_eps": [1e-6, 1e-5, *BAD],
    "rope_theta": [1e4, 1e6, *BAD],
    "rope_scaling": [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"type": "yarn", "factor": 4.0},
        {"rope_type": "dynamic"},
        {"rope_type": "nope"},
        "yarn",
        5,
        [],
    ],
    "qk_norm": [True, False, "no", 1, None],
    "attention_dropout": [0.0, 0.1, 1.0, -0.1, "0"],
    "tie_word_embeddings": [True, False, "yes"],
    "use_moe": [False, True, "yes", 1],
    "num_experts": [2, 4, 0, "4", 2.0],
    "num_experts_per_tok": [1, 2, 5, 0, "1"],
    "router_aux_loss_coef": [0.0, 5e-4, -1, "x", math.nan],
    "mlp_only_layers": [None, [], [0], [9], "0", [0.5]],
    "pad_token_id": [0, None, -1, 10**6, "0"],
    "eos_token_id": [2, [2, 3], None, -5],
    "hidden_act": ["silu", "gelu", "tanh-ish", 3],
}
FIELD_MESSAGE = r"^MiniMindConfig\.(\w+): .+\. Fix: .+\.$"


def draw_cases(n, seed=1234):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        fields = rng.sample(sorted(CHOICES), k=rng.randint(1, 6))
        cases.append({field: rng.choice(CHOICES[field]) for field in fields})
    return cases


@pytest.mark.parametrize("chunk", range(4))
def test_fuzzed_config_runs_or_names_fix(chunk):
    """Every fuzzed config runs or is refused with the field and fix."""
    base = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        intermediate_size=32,
    )
    outcomes = {"built": 0, "refused": 0}
    for case in draw_cases(200)[chunk::4]:
        try:
            config = MiniMindConfig(**{**base, **case})
        except ValueError as error:
            match = re.match(FIELD_MESSAGE, str(error))
            assert match, f"{case}: {error}"
            outcomes["refused"] += 1
            continue
        torch.manual_seed(0)
        model = MiniMindForCausalLM(config).eval()
        ids = torch.randint(0, config.vocab_size, (1, 5))
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, 5, config.vocab_size) and torch.isfinite(logits).all(), case
        outcomes["built"] += 1
    assert outcomes["built"] and outcomes["refused"]  # the draw covers both sides


@pytest.mark.parametrize(
    "case, field",
    [
        (dict(rms_norm_eps="1e-6"), "rms_norm_eps"),
        (dict(rope_scaling=5), "rope_scaling"),
        (dict(mlp_only_layers="0"), "mlp_only_layers"),
        (dict(router_aux_loss_coef="x"), "router_aux_loss_coef"),
        (dict(rope_scaling="yarn"), "rope_scaling"),
        (dict(qk_norm="no"), "qk_norm"),
        (dict(use_moe="yes"), "use_moe"),
        (dict(rope_theta=math.nan), "rope_theta"),
        (dict(pad_token_id=10**6), "pad_token_id"),
        (dict(pad_token_id=-1), "pad_token_id"),
        (dict(router_aux_loss_coef=-1), "router_aux_loss_coef"),
        (
            dict(rope_scaling={"type": "weird"}, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            "rope_scaling",
        ),
        (dict(rope_parameters={"rope_type": "dynamic"}), "rope_parameters"),
        (
            dict(
                rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}
            ),
            "rope_parameters",
        ),
        (
            dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
            "rope_parameters",
        ),
        (dict(num_hidden_layers=2.0), "num_hidden_layers"),
    ],
)
def test_past_slipped_values_are_refused(case, field):
    """Values that used to slip through are refused."""
    with pytest.raises(ValueError, match=rf"^MiniMindConfig\.{field}: .+\. Fix: .+\.$"):
        MiniMindConfig(**case)


def test_matching_legacy_rope_scaling_accepted():
    """A legacy rope_scaling equal to rope_parameters is accepted."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
    config = MiniMindConfig(rope_scaling=dict(rope), rope_parameters=dict(rope))
    assert config.rope_parameters == rope
