"""MiniMind configuration.

Field names follow transformers' Qwen3 / Qwen3-MoE configs and upstream MiniMind's, so a config (and the
checkpoint behind it) moves between the three without renaming. This file depends on transformers alone:
it is copied into every saved checkpoint and runs on the user's machine.
"""

import math

from transformers import PretrainedConfig

_KNOWN_ROPE_TYPES = ("default", "linear", "yarn")
# Upstream MiniMind's `inference_rope_scaling=True` preset: stretch a 2048-token training context 16x. Upstream
# leaves cos/sin unscaled (attention_factor 1.0, not YaRN's 0.1*ln(16)+1); its ramp clamp (dim/2-1 instead of
# dim-1) never binds for these values, so the frequencies equal upstream's as well.
_UPSTREAM_YARN_PRESET = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                         "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
_AUTO_MAP = {"AutoConfig": "configuration_minimind.MiniMindConfig",
             "AutoModel": "modeling_minimind.MiniMindModel",
             "AutoModelForCausalLM": "modeling_minimind.MiniMindForCausalLM"}


def _fail(field, problem, fix):
    raise ValueError(f"MiniMindConfig.{field}: {problem}. Fix: {fix}.")


def normalize_rope_parameters(rope_theta, rope_scaling=None, rope_parameters=None, max_position_embeddings=None):
    """Return one complete RoPE dict from either the legacy (`rope_theta` + `rope_scaling`) or the v5
    (`rope_parameters`) form: `{"rope_type", "rope_theta", ...scaling keys}`."""
    source = rope_parameters if rope_parameters else rope_scaling
    params = dict(source or {})
    if "type" in params:  # legacy spelling used by old configs
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", rope_theta)
    rope_type = params["rope_type"]
    if rope_type not in _KNOWN_ROPE_TYPES:
        _fail("rope_scaling", f"unknown rope_type {rope_type!r}", f"use one of {list(_KNOWN_ROPE_TYPES)}")
    if rope_type in ("yarn", "linear"):
        factor = params.get("factor")
        if factor is None:
            _fail("rope_scaling", f"rope_type {rope_type!r} needs a 'factor'",
                  "add e.g. 'factor': 4.0 (the context-length multiplier)")
        if not isinstance(factor, (int, float)) or factor < 1.0:
            _fail("rope_scaling", f"factor must be a number >= 1, got {factor!r}", "set 'factor' to 1.0 or more")
        params["factor"] = float(factor)
    if rope_type == "yarn":
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
    if not isinstance(params["rope_theta"], (int, float)) or params["rope_theta"] <= 0:
        _fail("rope_theta", f"must be a positive number, got {params['rope_theta']!r}", "use e.g. 1e6")
    return params


class MiniMindConfig(PretrainedConfig):
    r"""Configuration of a MiniMind decoder (Llama/Qwen3 family), dense or mixture-of-experts.

    Defaults give upstream MiniMind's 64M dense model. Every size is validated here, before any tensor is
    built, and a bad value raises `ValueError` naming the field and the fix.
    """

    model_type = "minimind"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

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
        router_aux_loss_coef=5e-4,
        output_router_logits=False,
        decoder_sparse_step=1,
        mlp_only_layers=None,
        **kwargs,
    ):
        for field, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                             ("num_hidden_layers", num_hidden_layers), ("num_attention_heads", num_attention_heads),
                             ("num_key_value_heads", num_key_value_heads),
                             ("max_position_embeddings", max_position_embeddings)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(field, f"must be a positive integer, got {value!r}", "pass a whole number > 0")
        if num_attention_heads % num_key_value_heads:
            _fail("num_key_value_heads", f"{num_attention_heads} query heads are not divisible by "
                  f"{num_key_value_heads} key/value heads", "choose num_key_value_heads dividing num_attention_heads")
        if head_dim is None:
            if hidden_size % num_attention_heads:
                _fail("head_dim", f"hidden_size {hidden_size} is not divisible by num_attention_heads "
                      f"{num_attention_heads}", "pass head_dim explicitly or change the head count")
            head_dim = hidden_size // num_attention_heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            _fail("head_dim", f"must be a positive even integer (RoPE rotates pairs), got {head_dim!r}",
                  "use an even head_dim such as 64")
        if intermediate_size is None:
            # Upstream MiniMind's rule: about pi x hidden, rounded up to a multiple of 64.
            intermediate_size = math.ceil(hidden_size * math.pi / 64) * 64
        if moe_intermediate_size is None:
            moe_intermediate_size = intermediate_size
        for field, value in (("intermediate_size", intermediate_size),
                             ("moe_intermediate_size", moe_intermediate_size)):
            if not isinstance(value, int) or value <= 0:
                _fail(field, f"must be a positive integer, got {value!r}", "pass a whole number > 0 or None")
        if not rms_norm_eps > 0:
            _fail("rms_norm_eps", f"must be > 0, got {rms_norm_eps!r}", "use e.g. 1e-6")
        if not 0.0 <= attention_dropout < 1.0:
            _fail("attention_dropout", f"must be in [0, 1), got {attention_dropout!r}", "use e.g. 0.0")
        if hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
            _fail("hidden_act", f"unsupported activation {hidden_act!r}", "use 'silu' (SwiGLU)")
        if use_moe:
            if not isinstance(num_experts, int) or num_experts <= 0:
                _fail("num_experts", f"must be a positive integer, got {num_experts!r}", "use e.g. 4")
            if not isinstance(num_experts_per_tok, int) or not 1 <= num_experts_per_tok <= num_experts:
                _fail("num_experts_per_tok", f"top-k {num_experts_per_tok!r} must be between 1 and num_experts "
                      f"({num_experts})", "lower num_experts_per_tok or add experts")
            if not isinstance(decoder_sparse_step, int) or decoder_sparse_step <= 0:
                _fail("decoder_sparse_step", f"must be a positive integer, got {decoder_sparse_step!r}",
                      "use 1 to make every layer sparse")
            if router_aux_loss_coef < 0:
                _fail("router_aux_loss_coef", f"must be >= 0, got {router_aux_loss_coef!r}", "use e.g. 5e-4")
        mlp_only_layers = list(mlp_only_layers or [])
        bad_layers = [i for i in mlp_only_layers if not 0 <= i < num_hidden_layers]
        if bad_layers:
            _fail("mlp_only_layers", f"layer indices {bad_layers} are outside 0..{num_hidden_layers - 1}",
                  "list existing layer indices only")

        if inference_rope_scaling and not (rope_scaling or rope_parameters):
            rope_scaling = dict(_UPSTREAM_YARN_PRESET)
        rope = normalize_rope_parameters(rope_theta, rope_scaling, rope_parameters, max_position_embeddings)

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope["rope_theta"]
        self.rope_parameters = rope
        # transformers 5 made `rope_scaling` a deprecated alias property of `rope_parameters`; 4.57 reads the
        # plain attribute. Only write it where it is still a plain attribute.
        if not isinstance(getattr(type(self), "rope_scaling", None), property):
            self.rope_scaling = None if rope["rope_type"] == "default" else dict(rope)
        self.inference_rope_scaling = inference_rope_scaling
        self.qk_norm = qk_norm
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.flash_attn = flash_attn
        self.use_cache = use_cache
        self.initializer_range = initializer_range
        self.use_moe = use_moe
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.router_aux_loss_coef = router_aux_loss_coef
        self.output_router_logits = output_router_logits
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = mlp_only_layers
        # Upstream's `flash_attn` switch picks the fused kernel (sdpa) or the explicit one (eager); an explicit
        # `attn_implementation` (from the caller or from_pretrained) wins.
        kwargs.setdefault("attn_implementation", None if flash_attn else "eager")
        # transformers writes auto_map only for the class being saved; name all three so that AutoModel works
        # on a checkpoint saved from the causal-LM class (and vice versa).
        kwargs["auto_map"] = {**_AUTO_MAP, **(kwargs.get("auto_map") or {})}
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def is_moe_layer(self, layer_idx):
        """Same rule as Qwen3-MoE: sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th."""
        return (self.use_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def minillama_0_04b(cls, **overrides):
        """Seed 002's MiniLLaMA-0.04B: 35,926,528 parameters (tied, no q/k norm)."""
        preset = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, intermediate_size=1408, tie_word_embeddings=True,
                      qk_norm=False)
        preset.update(overrides)
        return cls(**preset)


__all__ = ["MiniMindConfig"]

# Saved configs carry an `auto_map` entry, so checkpoints load with trust_remote_code anywhere.
MiniMindConfig.register_for_auto_class()
