# Copyright 2026 The MiniMind developers. Licensed under the Apache License, Version 2.0.
"""MiniMind configuration.

Field names follow transformers' Qwen3 / Qwen3-MoE configs and upstream MiniMind's, so a config
(and the checkpoint behind it) moves between the three without renaming. This file depends on
transformers alone: it is copied into every saved checkpoint and runs on the user's machine.
"""

import inspect
import math

from transformers import PretrainedConfig

# Upstream MiniMind's `inference_rope_scaling=True` preset: stretch a 2048-token training context
# 16x. Upstream leaves cos/sin unscaled (attention_factor 1.0, not YaRN's 0.1*ln(16)+1); its ramp
# clamp (dim/2-1 instead of dim-1) never binds for these values, so the frequencies equal upstream's
# as well.
_UPSTREAM_YARN_PRESET = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 2048,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.0,
}
_AUTO_MAP = {
    "AutoConfig": "configuration_minimind.MiniMindConfig",
    "AutoModel": "modeling_minimind.MiniMindModel",
    "AutoModelForCausalLM": "modeling_minimind.MiniMindForCausalLM",
    "AutoModelForSequenceClassification": "modeling_minimind.MiniMindForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_minimind.MiniMindForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_minimind.MiniMindForQuestionAnswering",
}
# The rope types transformers accepts for Qwen3, with the keys each one needs beyond
# rope_type/rope_theta. The scaled types that stretch a pre-training length default it to
# max_position_embeddings, as transformers does.
_ROPE_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
_ROPE_WITH_ORIGINAL_LENGTH = ("yarn", "longrope", "llama3")
_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")


# Every field the caller gives, by kind (see `_check`), with the fix a refusal suggests.
_FIELD_RULES = {
    "vocab_size": ("positive int", "pass the tokenizer's size, len(tokenizer)"),
    "hidden_size": ("positive int", "pass a whole number > 0, e.g. 768"),
    "num_hidden_layers": ("positive int", "pass a whole number > 0, e.g. 8"),
    "num_attention_heads": ("positive int", "pass a whole number > 0, e.g. 8"),
    "num_key_value_heads": ("positive int", "pass a divisor of num_attention_heads, e.g. 4"),
    "max_position_embeddings": ("positive int", "pass the context length, e.g. 32768"),
    "rms_norm_eps": ("positive number", "use e.g. 1e-6"),
    "initializer_range": ("non-negative number", "use e.g. 0.02"),
    "attention_dropout": ("probability", "use e.g. 0.0"),
    "router_aux_loss_coef": ("non-negative number", "use e.g. 5e-4, or 0 to switch the loss off"),
    "qk_norm": ("bool", "pass True or False"),
    "attention_bias": ("bool", "pass True or False"),
    "flash_attn": ("bool", "pass True (sdpa) or False (eager)"),
    "tie_word_embeddings": ("bool", "pass True or False"),
    "use_cache": ("bool", "pass True or False"),
    "use_moe": ("bool", "pass True or False"),
    "norm_topk_prob": ("bool", "pass True or False"),
    "output_router_logits": ("bool", "pass True or False"),
    "inference_rope_scaling": ("bool", "pass True or False"),
}


# Each expert's projections are separate Linear modules here. Like Qwen3-MoE's plan, every expert's intermediate
# width is split across ranks and the experts module sums the partial outputs once per layer ("moe_tp_experts"),
# each projection running on its local shard ("local_params"). Releases without "local_params" (5.17) split the
# same way but reduce after each expert's down projection. Shared experts split as Qwen2-MoE's shared expert.
# Only a MoE model has these: every entry of a model's plan must match one of its parameters or modules.
_EXPERT_TP_PLAN = {
    "layers.*.mlp.experts.*.gate_proj.weight": "colwise",
    "layers.*.mlp.experts.*.up_proj.weight": "colwise",
    "layers.*.mlp.experts.*.down_proj.weight": "rowwise",
    "layers.*.mlp.experts.*.gate_proj": "local_params",
    "layers.*.mlp.experts.*.up_proj": "local_params",
    "layers.*.mlp.experts.*.down_proj": "local_params",
    "layers.*.mlp.experts": "moe_tp_experts",
}


def _split_mlp_plan(prefix):
    """One SwiGLU MLP's plan, as Qwen3's for its MLP: gate/up column-wise, down row-wise."""
    return {f"{prefix}.gate_proj": "colwise", f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}


def _expert_tp_plan(n_shared_experts):
    try:  # the registry fills when the module is imported; absent before 5.x
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        has_local_params = "local_params" in ALL_PARALLEL_STYLES
    except ImportError:
        has_local_params = False
    plan = dict(_EXPERT_TP_PLAN) if has_local_params else _split_mlp_plan("layers.*.mlp.experts.*")
    return {**plan, **(_split_mlp_plan("layers.*.mlp.shared_experts.*") if n_shared_experts else {})}


def _fail(field, problem, fix):
    raise ValueError(f"MiniMindConfig.{field}: {problem}. Fix: {fix}.")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(field, value, kind, fix):
    """One rule per kind of field: the value's type and range, or a ValueError naming the fix."""
    rules = {
        "positive int": (_is_int(value) and value > 0, "must be a positive integer"),
        "positive number": (_is_number(value) and value > 0, "must be a positive finite number"),
        "non-negative number": (_is_number(value) and value >= 0, "must be a finite number >= 0"),
        "probability": (_is_number(value) and 0 <= value < 1, "must be a number in [0, 1)"),
        "bool": (isinstance(value, bool), "must be True or False"),
    }
    ok, problem = rules[kind]
    if not ok:
        _fail(field, f"{problem}, got {value!r}", fix)


def normalize_rope_parameters(
    rope_theta, rope_scaling=None, rope_parameters=None, max_position_embeddings=None, head_dim=None
):
    """One complete RoPE dict (`{"rope_type", "rope_theta", ...scaling keys}`) from the legacy form
    (`rope_theta` + `rope_scaling`, with `type` or `rope_type`) or the v5 form
    (`rope_parameters`)."""
    forms = {}
    for field, source in (("rope_scaling", rope_scaling), ("rope_parameters", rope_parameters)):
        if source is None:
            continue
        if not isinstance(source, dict):
            example = {"rope_type": "yarn", "factor": 4.0}
            _fail(field, f"must be a dict such as {example}, got {source!r}", "pass a dict, or None for plain RoPE")
        forms[field] = _normalize_rope_dict(field, source, rope_theta, max_position_embeddings, head_dim)
    if len(forms) == 2 and forms["rope_scaling"] != forms["rope_parameters"]:
        legacy, current = forms["rope_scaling"], forms["rope_parameters"]
        _fail(
            "rope_scaling",
            f"{legacy} contradicts rope_parameters {current}",
            "pass only rope_parameters (rope_scaling is its legacy name)",
        )
    if forms:
        return forms.get("rope_parameters", forms.get("rope_scaling"))
    return _normalize_rope_dict("rope_theta", {}, rope_theta, max_position_embeddings, head_dim)


def _normalize_rope_dict(field, source, rope_theta, max_position_embeddings, head_dim):
    params = dict(source)
    if "type" in params:  # legacy spelling used by old configs
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", rope_theta)
    rope_type = params["rope_type"]
    if rope_type not in _ROPE_REQUIRED_KEYS:
        _fail(field, f"unknown rope_type {rope_type!r}", f"use one of {list(_ROPE_REQUIRED_KEYS)}")
    _check("rope_theta", params["rope_theta"], "positive number", "use e.g. 1e6")
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        _fail(field, f"rope_type {rope_type!r} needs {missing}", f"add {missing} (see transformers' RoPE docs)")
    if "factor" in params and params["factor"] is not None:
        if not _is_number(params["factor"]) or params["factor"] < 1:
            _fail(
                field,
                f"factor must be a number >= 1, got {params['factor']!r}",
                "set 'factor' to the context-length multiplier, 1.0 or more",
            )
        params["factor"] = float(params["factor"])
    if rope_type in _ROPE_WITH_ORIGINAL_LENGTH:
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
        _check(
            field,
            params["original_max_position_embeddings"],
            "positive int",
            "set 'original_max_position_embeddings' to the pre-training context length",
        )
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = params[key]
            if (
                not isinstance(factors, (list, tuple))
                or len(factors) != head_dim // 2
                or not all(_is_number(f) for f in factors)
            ):
                _fail(
                    field,
                    f"{key} must list head_dim/2 = {head_dim // 2} numbers, got {factors!r}",
                    f"give one factor per rotary frequency ({head_dim // 2})",
                )
    if rope_type == "llama3":
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        if not (_is_number(low) and _is_number(high) and high > low > 0):
            _fail(
                field,
                f"needs 0 < low_freq_factor < high_freq_factor, got {low!r} and {high!r}",
                "use e.g. low_freq_factor 1.0, high_freq_factor 4.0",
            )
    return params


class MiniMindConfig(PretrainedConfig):
    r"""Configuration of a MiniMind decoder (Llama/Qwen3 family), dense or mixture-of-experts.

    Defaults give upstream MiniMind's 64M dense model. Every field is validated here, before any
    tensor is built, and a bad value raises `ValueError` naming the field and the fix.
    """

    model_type = "minimind"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")`): Qwen3's plan (MoE configs add
    # _EXPERT_TP_PLAN in __init__). Heads split across ranks; q/k norms act per head, so they
    # replicate.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    def __init__(
        self,
        vocab_size=6400,
        hidden_size=768,
        intermediate_size=None,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        rope_parameters=None,
        inference_rope_scaling=False,
        qk_norm=True,
        attention_bias=False,
        attention_dropout=0.0,
        flash_attn=True,
        tie_word_embeddings=True,
        use_cache=True,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        use_moe=False,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=None,
        norm_topk_prob=True,
        n_shared_experts=0,
        router_aux_loss_coef=5e-4,
        output_router_logits=False,
        decoder_sparse_step=1,
        mlp_only_layers=None,
        **kwargs,
    ):
        # 1. Check what the caller gave, 2. derive the sizes left as None, 3. check what depends on
        # them.
        given = dict(locals())  # every argument by name, for the rule table
        for field, (kind, fix) in _FIELD_RULES.items():
            _check(field, given[field], kind, fix)
        if hidden_act not in _ACTIVATIONS:
            _fail("hidden_act", f"unsupported activation {hidden_act!r}", "use 'silu' (SwiGLU)")
        if num_attention_heads % num_key_value_heads:
            _fail(
                "num_key_value_heads",
                f"{num_attention_heads} query heads are not divisible by {num_key_value_heads} key/value heads",
                "choose num_key_value_heads dividing num_attention_heads",
            )

        if head_dim is None:
            if hidden_size % num_attention_heads:
                _fail(
                    "head_dim",
                    f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}",
                    "pass head_dim explicitly or change the head count",
                )
            head_dim = hidden_size // num_attention_heads
        if intermediate_size is None:
            # Upstream MiniMind's rule: about pi x hidden, rounded up to a multiple of 64.
            intermediate_size = math.ceil(hidden_size * math.pi / 64) * 64
        if moe_intermediate_size is None:
            moe_intermediate_size = intermediate_size
        if inference_rope_scaling and not (rope_scaling or rope_parameters):
            rope_scaling = dict(_UPSTREAM_YARN_PRESET)

        _check("head_dim", head_dim, "positive int", "use an even head_dim such as 64")
        if head_dim % 2:
            _fail("head_dim", f"must be even (RoPE rotates pairs), got {head_dim}", "use an even head_dim such as 64")
        for field, size in (
            ("intermediate_size", intermediate_size),
            ("moe_intermediate_size", moe_intermediate_size),
        ):
            _check(field, size, "positive int", "pass a whole number > 0 or None")
        if use_moe:
            _check("num_experts", num_experts, "positive int", "use e.g. 4")
            _check("decoder_sparse_step", decoder_sparse_step, "positive int", "use 1 to make every layer sparse")
            if not _is_int(num_experts_per_tok) or not 1 <= num_experts_per_tok <= num_experts:
                _fail(
                    "num_experts_per_tok",
                    f"top-k {num_experts_per_tok!r} must be between 1 and num_experts ({num_experts})",
                    "lower num_experts_per_tok or add experts",
                )
        if not _is_int(n_shared_experts) or n_shared_experts < 0:
            _fail("n_shared_experts", f"must be an integer >= 0, got {n_shared_experts!r}", "use 0, or e.g. 1")
        if mlp_only_layers is not None and not isinstance(mlp_only_layers, (list, tuple)):
            _fail("mlp_only_layers", f"must be a list of layer indices, got {mlp_only_layers!r}", "pass e.g. [0]")
        mlp_only_layers = list(mlp_only_layers or [])
        bad_layers = [i for i in mlp_only_layers if not _is_int(i) or not 0 <= i < num_hidden_layers]
        if bad_layers:
            _fail(
                "mlp_only_layers",
                f"layer indices {bad_layers} are outside 0..{num_hidden_layers - 1}",
                "list existing layer indices only",
            )
        for field, token_id in (
            ("bos_token_id", bos_token_id),
            ("eos_token_id", eos_token_id),
            ("pad_token_id", pad_token_id),
        ):
            ids = token_id if isinstance(token_id, (list, tuple)) else [token_id]
            if any(i is not None and (not _is_int(i) or not 0 <= i < vocab_size) for i in ids):
                _fail(
                    field,
                    f"{token_id!r} is not a token id in [0, {vocab_size})",
                    "use the tokenizer's id for it, or None",
                )
        rope = normalize_rope_parameters(rope_theta, rope_scaling, rope_parameters, max_position_embeddings, head_dim)

        # The signature is the one list of fields (MiniMindConfig.FIELDS); those derived or normalised above take
        # their final values here, the passed-through token ids and tying go to PretrainedConfig.
        given.update(
            intermediate_size=intermediate_size,
            moe_intermediate_size=moe_intermediate_size,
            head_dim=head_dim,
            mlp_only_layers=mlp_only_layers,
        )
        for field in self.FIELDS:
            if field not in _SET_ELSEWHERE:
                setattr(self, field, given[field])
        self.rope_theta = rope["rope_theta"]
        self.rope_parameters = rope
        # transformers 5 made `rope_scaling` a deprecated alias property of `rope_parameters`; 4.57 reads the
        # plain attribute. Only write it where it is still a plain attribute.
        if not isinstance(getattr(type(self), "rope_scaling", None), property):
            self.rope_scaling = None if rope["rope_type"] == "default" else dict(rope)
        if use_moe:
            # Only MoE configs carry these: libraries (TRL's trainers among them) switch on their MoE aux-loss path
            # when a config has `output_router_logits`, as Qwen3-MoE's does.
            self.router_aux_loss_coef = router_aux_loss_coef
            self.output_router_logits = output_router_logits
        if use_moe:  # before super().__init__(): 5.17 extends the instance's plan for tied embeddings
            self.base_model_tp_plan = {**type(self).base_model_tp_plan, **_expert_tp_plan(n_shared_experts)}
        # Upstream's `flash_attn` switch picks the fused kernel (sdpa) or the explicit one (eager);
        # an explicit `attn_implementation` (from the caller or from_pretrained) wins.
        kwargs.setdefault("attn_implementation", None if flash_attn else "eager")
        # transformers writes auto_map only for the class being saved; name all three so that
        # AutoModel works on a checkpoint saved from the causal-LM class (and vice versa).
        kwargs["auto_map"] = {**_AUTO_MAP, **(kwargs.get("auto_map") or {})}
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def is_moe_layer(self, layer_idx):
        """Qwen3-MoE's rule: sparse unless in `mlp_only_layers`, every `decoder_sparse_step`-th."""
        return (
            self.use_moe and layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def minillama_0_04b(cls, **overrides):
        """The MiniLLaMA-0.04B preset: 35,926,528 parameters (tied, no q/k norm)."""
        preset = dict(
            vocab_size=4096,
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1408,
            tie_word_embeddings=True,
            qk_norm=False,
        )
        preset.update(overrides)
        return cls(**preset)


# Every field of the config, in the order of its signature: the one list other code derives its field lists from.
MiniMindConfig.FIELDS = tuple(
    name for name in inspect.signature(MiniMindConfig.__init__).parameters if name not in ("self", "kwargs")
)
_SET_ELSEWHERE = (
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "router_aux_loss_coef",
    "output_router_logits",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

__all__ = ["MiniMindConfig"]

# Saved configs carry an `auto_map` entry, so checkpoints load with trust_remote_code anywhere.
MiniMindConfig.register_for_auto_class()
