# Copyright 2026 The MiniMind developers. Licensed under the Apache License, Version 2.0.
"""MiniMind: a Llama/Qwen3-family decoder as a transformers model.

In the order and with the names of transformers' `models/qwen3/modeling_qwen3.py`, with Qwen3-MoE's
mixture-of-experts classes where Qwen3 has its MLP, so the two read side by side. Every deliberate
difference is marked `# MiniMind:`. State-dict names equal Qwen3ForCausalLM's (and upstream MiniMind's
for the experts), so weights move between the three with strict key matching.

Shapes: B batch, T new tokens, S = cached + new tokens, D hidden, H query heads, K key/value heads,
Dh head_dim, E experts, k experts per token, N = B*T tokens, V vocabulary.

This file depends on torch and transformers alone and runs under transformers 4.57, 5.17 and 5.24+:
it is copied into every saved checkpoint. Every difference between those releases is in the first block.
"""

import functools
import inspect
import json
import os
import struct
from pathlib import Path

try:  # Python 3.11+
    from typing import Unpack
except ImportError:  # 3.10
    from typing_extensions import Unpack

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import TransformersKwargs, can_return_tuple, logging

try:  # inside a checkpoint (trust_remote_code) or the installed package
    from .configuration_minimind import MiniMindConfig
except ImportError:  # the repo root on sys.path
    from configuration_minimind import MiniMindConfig

logger = logging.get_logger(__name__)


# ---- transformers releases: 4.57, 5.17, 5.24+ (dropping one = deleting its branch) ----------------------
# 5.24 renamed the cache keyword and output field `past_key_values` -> `cache`; the old keyword warns there,
# as Qwen3's does. Before 5.24 `past_key_values` is the keyword generate passes, taken here without a word.
_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
if _CACHE_FIELD == "cache":
    from transformers.utils.deprecation import deprecate_kwarg

    _cache_kwarg = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
else:

    def _cache_kwarg(forward):
        @functools.wraps(forward)
        def renamed(*args, past_key_values=None, **kwargs):
            if past_key_values is not None and kwargs.get("cache") is None:
                kwargs["cache"] = past_key_values
            return forward(*args, **kwargs)

        return renamed


# create_causal_mask takes `cache` in 5.24+, `past_key_values` before (and `cache_position` in 4.57).
_MASK_PARAMS = inspect.signature(create_causal_mask).parameters
_MASK_CACHE_KEYWORD = "cache" if "cache" in _MASK_PARAMS else "past_key_values"

try:  # 5.x: output capturing hooks
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError:  # 4.57: the same contract under its older name
    from transformers.utils.generic import OutputRecorder
    from transformers.utils.generic import check_model_inputs as capture_outputs

try:  # 5.x: the library's expert kernels (batched_mm, grouped_mm), chosen by `experts_implementation`
    from transformers.integrations.moe import use_experts_implementation
except ImportError:  # 4.57: MiniMind's own dispatch only

    def use_experts_implementation(experts_class):
        return experts_class


# The attention kernel. `set_attn_implementation` only switches models whose source reads the registry in
# these exact words, so keep them as they are.
if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # 5.x

    def _attention_interface(self):
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)

else:  # 4.57: no get_interface and no "eager" entry

    def _attention_interface(self):
        if self.config._attn_implementation == "eager":
            return eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]


def _kernel_writes_cache(cache):
    """True for the paged cache of continuous batching in 4.57 and 5.17: their paged attention kernel writes it
    (its update() takes read/write indices), so the layer hands it over instead of updating it."""
    return cache is not None and not isinstance(cache, Cache) and _update_takes_indices(type(cache))


@functools.cache
def _update_takes_indices(cache_class):  # once per class: this runs in every layer of every step
    return "read_index" in inspect.signature(cache_class.update).parameters


# ---- the model, in modeling_qwen3.py's order ----------------------------------------------------------


class MiniMindRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # MiniMind: torch's fused rms_norm; statistics in fp32 (bf16 loses the mean of squares), scale in x's dtype.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


class MiniMindMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)); also one expert of the MoE layer (Qwen3MoeMLP)."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MiniMindRotaryEmbedding(nn.Module):
    """cos/sin for given positions, computed on the fly: no table to outgrow, nothing to save."""

    def __init__(self, config, device=None):  # MiniMind: `device` as in 4.57 / 5.17 (5.24's Qwen3 dropped it)
        super().__init__()
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        # MiniMind: one entry point for every rope type, also what 4.57's dynamic_rope_update calls.
        self.rope_init_fn = self.compute_rope_parameters
        inv_freq, self.attention_scaling = self.rope_init_fn(config, device)
        # Non-persistent: `from_pretrained` leaves them uninitialised, so `_init_weights` recomputes them.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, **kwargs):
        """Plain RoPE: inverse frequencies theta^(-2i/Dh) [Dh/2] in fp32, and no cos/sin scaling."""
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
        return 1.0 / (base**exponents), 1.0

    @staticmethod
    def compute_rope_parameters(config, device=None, seq_len=None, **kwargs):
        """(inv_freq [Dh/2], attention scaling); the scaled types use transformers' own initialisation."""
        rope_type = config.rope_parameters["rope_type"]
        if rope_type == "default":
            return MiniMindRotaryEmbedding.compute_default_rope_parameters(config, device)
        if seq_len is None:
            return ROPE_INIT_FUNCTIONS[rope_type](config, device)
        return ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=seq_len)

    @torch.no_grad()
    @dynamic_rope_update  # `dynamic` and `longrope` recompute their frequencies past the trained length
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()  # [B, T, Dh/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, Dh]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Rotate q [B, H, T, Dh] and k [B, K, T, Dh] by position angles (cos/sin [B, T, Dh])."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    """[B, K, S, Dh] -> [B, K*n_rep, S, Dh]: each key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, k, s, d = x.shape
    return x[:, :, None].expand(b, k, n_rep, s, d).reshape(b, k * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """q [B, H, T, Dh], k/v [B, K, S, Dh], mask [B, 1, T, S] -> [B, T, H, Dh] and the probabilities."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, T, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # MiniMind: custom 4-D masks may be boolean (True = attend)
            attention_mask = torch.zeros_like(attention_mask, dtype=scores.dtype).masked_fill(
                ~attention_mask, torch.finfo(scores.dtype).min
            )
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # [B, H, T, Dh]
    return out.transpose(1, 2).contiguous(), probs


class MiniMindAttention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (before RoPE)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_bias)
        if config.qk_norm:
            self.q_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:  # MiniMind: upstream's MiniMind2 checkpoints have no q/k norm
            self.q_norm = self.k_norm = nn.Identity()

    @_cache_kwarg
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]  # [B, T]
        hidden_shape = (*input_shape, -1, self.head_dim)  # -1: the heads (this rank's share under TP)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # [B, K, T, Dh]
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, K, T, Dh]
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        cache_position = kwargs.pop("cache_position", None)
        if _kernel_writes_cache(cache):
            kwargs["cache"] = cache
        elif cache is not None:
            # MiniMind: 4.57's StaticCache reads cache_position from these kwargs, the paged cache of continuous
            # batching fills in what its kernel needs, the other caches ignore them.
            k, v = cache.update(k, v, self.layer_idx, {**kwargs, "cache_position": cache_position})  # [B, K, S, Dh]

        attention_interface = _attention_interface(self)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )  # [B, T, H, Dh]
        out = self.o_proj(out.reshape(*input_shape, -1))  # [B, T, D]
        return out, weights


# MiniMind: Qwen3-MoE's expert classes, in its order, beside Qwen3's dense MLP.
@use_experts_implementation
class MiniMindExperts(nn.ModuleList):
    """The experts, one SwiGLU MLP each (state-dict names `experts.<e>.{gate,up,down}_proj.weight`).

    MiniMind: the default ("eager") dispatch sorts the N*k (token, expert) assignments by expert once, runs each
    expert as one matmul over its contiguous slice and scatters the weighted results back. Under torch.compile it
    runs every expert on every token instead, with no host sync. `experts_implementation` "batched_mm" /
    "grouped_mm" runs transformers' kernels (as Qwen3-MoE does) over the stacked weights below."""

    def __init__(self, config):
        super().__init__(MiniMindMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.num_experts = config.num_experts
        # Under tensor parallelism the kernels below read each rank's shard of every expert when the plan sums the
        # experts' partial outputs ("moe_tp_experts", as Qwen3-MoE's), and the whole weights otherwise.
        self._sums_partial_outputs = "moe_tp_experts" in (config.base_model_tp_plan or {}).values()

    @property
    def act_fn(self):  # a property, so that the list holds the experts alone
        return self[0].act_fn

    def _weights(self, projection):
        weights = [getattr(expert, projection).weight for expert in self]
        if hasattr(weights[0], "to_local"):  # a DTensor: see __init__
            weights = [w.to_local() if self._sums_partial_outputs else w.full_tensor() for w in weights]
        return torch.stack(weights)

    @property
    def gate_up_proj(self):  # [E, 2I, D], the layout transformers' expert kernels read
        return torch.cat([self._weights("gate_proj"), self._weights("up_proj")], dim=1)

    @property
    def down_proj(self):  # [E, D, I]
        return self._weights("down_proj")

    def forward(self, x, top_k_index, top_k_weights):
        """x [N, D], expert ids and weights [N, k] -> each token's weighted expert sum [N, D]."""
        if torch.compiler.is_compiling():
            return self._forward_every_expert(x, top_k_index, top_k_weights)
        top_k = top_k_index.shape[-1]
        flat_experts = top_k_index.reshape(-1)  # [N*k]
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert
        token_ids = order // top_k  # [N*k]: the token each sorted assignment belongs to
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()  # one host sync per layer
        grouped = x[token_ids]  # [N*k, D]
        # Without autograd, experts that got no tokens are skipped (a decode step leaves most of them idle); with
        # it, every expert runs so that each gets a (zero) gradient, as optimisers and DDP expect.
        expert_out = torch.cat(
            [
                expert(chunk)
                for expert, chunk in zip(self, grouped.split(counts))
                if len(chunk) or torch.is_grad_enabled()
            ]
        )  # [N*k, D]
        expert_out = expert_out * top_k_weights.reshape(-1)[order, None].to(expert_out.dtype)
        # Summed in the residual stream's dtype: under bf16 autocast the top-k outputs add up as in Qwen3-MoE.
        return x.new_zeros(x.shape).index_add_(0, token_ids, expert_out.to(x.dtype))

    def _forward_every_expert(self, x, top_k_index, top_k_weights):
        """The compiled path: shapes independent of the routing, so fullgraph=True traces it."""
        weights = x.new_zeros(x.shape[0], self.num_experts, dtype=top_k_weights.dtype)
        weights = weights.scatter_add(1, top_k_index, top_k_weights)  # [N, E], zero where not routed
        out = x.new_zeros(x.shape)
        for e, expert in enumerate(self):
            out = out + (expert(x) * weights[:, e, None].to(x.dtype)).to(x.dtype)
        return out


class MiniMindTopKRouter(nn.Module):
    """Linear router: x [N, D] -> logits [N, E], top-k weights [N, k] (fp32), expert ids [N, k]."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x):
        router_logits = F.linear(x, self.weight)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            # MiniMind: with k=1 the renormalised weight is exactly 1 and would carry no gradient to the router.
            # Dividing by the detached value keeps it 1 (Qwen3-MoE's numbers) and lets the LM loss reach the
            # router through p / stopgrad(p).
            denom = weights.sum(dim=-1, keepdim=True) if self.top_k > 1 else weights.detach()
            weights = weights / denom
        return router_logits, weights, experts


class MiniMindSparseMoeBlock(nn.Module):
    """Top-k mixture of SwiGLU experts behind a linear router, plus optional always-on shared experts."""

    def __init__(self, config):
        super().__init__()
        self.gate = MiniMindTopKRouter(config)
        self.experts = MiniMindExperts(config)
        # MiniMind: upstream MiniMind2-MoE's shared experts, each added to every token's output, unweighted.
        if config.n_shared_experts:
            size = config.moe_intermediate_size
            self.shared_experts = nn.ModuleList(MiniMindMLP(config, size) for _ in range(config.n_shared_experts))

    def forward(self, hidden_states):
        batch, seq, dim = hidden_states.shape
        x = hidden_states.reshape(-1, dim)  # [N, D]
        _, weights, experts = self.gate(x)  # the logits reach the aux loss via the output recorder
        out = self.experts(x, experts, weights).view(batch, seq, dim)
        for shared in getattr(self, "shared_experts", ()):
            out = out + shared(hidden_states)
        return out


class MiniMindDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniMindAttention(config, layer_idx)
        self.mlp = MiniMindSparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MiniMindMLP(config)
        self.input_layernorm = MiniMindRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniMindRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @_cache_kwarg
    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, cache=cache, **kwargs
        )
        hidden_states = residual + hidden_states  # [B, T, D]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))  # [B, T, D]


class _PerModel:
    """MiniMind: a classmethod that a model instance answers for its own config (see its use)."""

    def __init__(self, function):
        self.function = function

    def __get__(self, model, cls):
        return functools.partial(self.function, cls, model)


class MiniMindPreTrainedModel(PreTrainedModel):
    config_class = MiniMindConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MiniMindDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_flash_attn_2 = True  # MiniMind: the flag's older name, for 4.57
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MiniMindTopKRouter, index=0),
        "hidden_states": MiniMindDecoderLayer,
        "attentions": MiniMindAttention,
    }

    @_PerModel
    def _can_set_experts_implementation(cls, model=None):
        # MiniMind: one file serves dense and MoE configs. transformers asks the class (it reads the source); a
        # dense model answers for its config, as dense Qwen3: no experts, so no experts implementation to set.
        source_check = getattr(PreTrainedModel, "_can_set_experts_implementation", None)  # absent in 4.57
        can_set = source_check is not None and source_check.__func__(cls)
        return can_set and (model is None or model.config.use_moe)

    def get_correct_experts_implementation(self, requested_experts):
        # MiniMind: its sorted dispatch ("eager") is the default, the faster one on a CPU.
        return super().get_correct_experts_implementation(requested_experts or "eager")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as err:  # MiniMind: safetensors names neither the file nor the directory
            folder = Path(str(pretrained_model_name_or_path))
            files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
            damaged = [f"{path} ({problem})" for path in files if (problem := safetensors_problem(path))]
            where = ", ".join(damaged) or f"a weights file of {pretrained_model_name_or_path}"
            raise OSError(
                f"{where}: the safetensors file is incomplete or damaged ({err}). Fix: copy or download it again; "
                f"a checkpoint killed mid-save is not loadable, take an earlier one."
            ) from err

    def _init_weights(self, module):
        # torch.nn.init (not `.data`) so that transformers skips tensors already loaded from a checkpoint.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, MiniMindTopKRouter):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MiniMindRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, MiniMindRotaryEmbedding):
            # Non-persistent buffers come back as uninitialised memory from `from_pretrained` (5.x).
            inv_freq, module.attention_scaling = module.rope_init_fn(module.config, module.inv_freq.device)
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)
                module.original_inv_freq.copy_(inv_freq)


class MiniMindModel(MiniMindPreTrainedModel):
    """Embeddings, decoder layers and final norm: input ids [B, T] -> hidden states [B, T, D]."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMindDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniMindRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MiniMindRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @capture_outputs
    @_cache_kwarg
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MiniMind needs exactly one of input_ids or inputs_embeds.")
        kwargs.pop("cache_position", None)  # from 4.57's generate; recomputed below
        if isinstance(cache, (tuple, list)):  # MiniMind: legacy ((k, v), ...) per layer
            cache = DynamicCache(cache)
        if use_cache is None:  # MiniMind: a training forward would only fill a cache nobody reads
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # recomputation would write every layer's keys into the cache twice
        fresh_cache = use_cache and cache is None
        if fresh_cache:
            cache = DynamicCache(config=self.config)

        batch, q_len = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        # MiniMind: bad input fails here naming the fix, not later as garbage. The paged cache of continuous
        # batching is no `Cache`: it brings its own positions and masks.
        past_seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        check_inputs(self.config, input_ids, attention_mask, batch, q_len, past_seen)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [B, T, D]

        # arange + offset (not arange(offset, ...)): the offset is a tensor for StaticCache, and this form keeps
        # torch.compile(fullgraph=True) free of unbacked symbols.
        cache_position = torch.arange(q_len, device=inputs_embeds.device) + past_seen
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)  # [1, T]
            self._warn_past_trained_length(past_seen, q_len)
        elif position_ids.shape[-1] != q_len:
            # generate() derives position ids from the 2-D mask: a mask of the wrong length lands here.
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} tokens but the input has {q_len}. Fix: pass one "
                f"position per input token; with generate(), pass an attention_mask with one column per prompt "
                f"token (the one the tokenizer returned)."
            )

        # A cache made here is still empty, so the mask needs none; without one, create_causal_mask finds packed
        # rows (restarting position_ids) and keeps attention inside each.
        mask_kwargs = {_MASK_CACHE_KEYWORD: None if fresh_cache or _kernel_writes_cache(cache) else cache}
        if "cache_position" in _MASK_PARAMS:
            mask_kwargs["cache_position"] = cache_position
        if isinstance(causal_mask := attention_mask, dict):  # prepared by generate for a static cache
            causal_mask = causal_mask["full_attention"]
        else:
            causal_mask = create_causal_mask(
                self.config, inputs_embeds, attention_mask, position_ids=position_ids, **mask_kwargs
            )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)  # cos, sin [B|1, T, Dh]
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                cache_position=cache_position,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        output_class = MoeModelOutputWithPast if self.config.use_moe else BaseModelOutputWithPast
        return output_class(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache if use_cache else None})

    def _warn_past_trained_length(self, past_seen, q_len):
        # MiniMind: RoPE runs past the trained length (as in Qwen3); say once what to expect.
        if isinstance(past_seen, int) and past_seen + q_len > self.config.max_position_embeddings:
            logger.warning_once(
                f"A sequence is longer than max_position_embeddings={self.config.max_position_embeddings}; quality "
                f"may drop past the trained length. RoPE scaling (rope_parameters with rope_type 'dynamic' or "
                f"'yarn') extends the context."
            )


def load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask=None):
    """Switch-Transformer balance loss E * sum_e f_e * P_e over all MoE layers (k when uniform).

    f_e: share of the top-k assignments that went to expert e; P_e: mean router probability of e. Padding rows
    are left out when a matching [B, T] mask is given (during cached decoding it does not match: no mask)."""
    if not router_logits:
        return None
    logits = torch.cat([layer.float() for layer in router_logits], dim=0)  # [L*N, E]
    probs = F.softmax(logits, dim=-1)
    top_k_ids = probs.topk(top_k, dim=-1).indices
    chosen = F.one_hot(top_k_ids, num_experts).sum(dim=1).float()  # [L*N, E]
    rows = router_logits[0].shape[0]
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.numel() == rows:
        keep = attention_mask.reshape(-1).float().repeat(len(router_logits))[:, None]  # [L*N, 1]
        tokens_per_expert = (chosen * keep).sum(0) / keep.sum()
        prob_per_expert = (probs * keep).sum(0) / keep.sum()
    else:
        tokens_per_expert, prob_per_expert = chosen.mean(0), probs.mean(0)
    return num_experts * torch.sum(tokens_per_expert * prob_per_expert)


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    """The backbone plus a (tied by default) LM head: logits [B, T, V], shifted-label loss, MoE aux loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config):
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):  # MiniMind: 4.57 looks for them here
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @can_return_tuple
    @_cache_kwarg
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_router_logits=None,
        logits_to_keep=0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        """`labels` [B, T] are the input ids themselves (-100 = ignore); the loss shifts them. With an int
        `logits_to_keep`, the loss covers the kept last positions (labels cut to match)."""
        config = self.config
        if config.use_moe:
            if output_router_logits is None:
                output_router_logits = config.output_router_logits
            # MiniMind: the aux loss joins the loss whenever labels are given, so the Trainer optimises it.
            kwargs["output_router_logits"] = output_router_logits or labels is not None
        # The Trainer's `num_items_in_batch` goes to the loss, not to the backbone.
        loss_kwargs = {
            key: kwargs.pop(key) for key in ("num_items_in_batch", "ignore_index", "shift_labels") if key in kwargs
        }
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state  # [B, T, D]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # [B, T_kept, V]

        loss = None
        if labels is not None:
            labels = self._labels_for(labels, logits, logits_to_keep)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
        common = dict(logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        common[_CACHE_FIELD] = getattr(outputs, _CACHE_FIELD)
        if not config.use_moe:
            return CausalLMOutputWithPast(loss=loss, **common)

        aux_loss = None
        if kwargs["output_router_logits"]:
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
            )
            if loss is not None and aux_loss is not None:
                loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)
        router_logits = outputs.router_logits if kwargs["output_router_logits"] else None
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, router_logits=router_logits, **common)

    def generate(self, inputs=None, *args, **kwargs):
        check_generation_mask(inputs, kwargs)  # MiniMind: before generate turns the mask into positions
        return super().generate(inputs, *args, **kwargs)

    @staticmethod
    def _labels_for(labels, logits, logits_to_keep):
        if labels.shape[1] == logits.shape[1]:
            return labels
        if not isinstance(logits_to_keep, int):
            raise ValueError(
                "labels with a tensor logits_to_keep are ambiguous. Fix: pass an int logits_to_keep, or labels "
                "already aligned to the kept positions."
            )
        return labels[:, -logits.shape[1] :]


class MiniMindTaskHead(MiniMindPreTrainedModel):
    def __init__(self, config):
        # MiniMind: transformers' generic heads build their backbone with AutoModel.from_config. Loaded as remote
        # code, the config's class can be another module's copy of MiniMindConfig than the one registered below,
        # so the backbone is registered for the config's own class.
        AutoModel.register(type(config), MiniMindModel, exist_ok=True)
        super().__init__(config)


class MiniMindForSequenceClassification(GenericForSequenceClassification, MiniMindTaskHead):
    pass


class MiniMindForTokenClassification(GenericForTokenClassification, MiniMindTaskHead):
    pass


class MiniMindForQuestionAnswering(GenericForQuestionAnswering, MiniMindTaskHead):
    pass  # MiniMind: the backbone stays `model` (Qwen3's is `transformer`), so causal-LM checkpoints load into it


# ---- MiniMind: input checks and damaged files (Qwen3 has none) ------------------------------------------


def check_inputs(config, input_ids, attention_mask, batch, q_len, past_seen):
    if q_len == 0:
        raise ValueError(
            "MiniMind got an empty sequence (0 tokens). Fix: pass at least one token, e.g. the tokenizer's "
            "bos_token_id as the prompt."
        )
    if input_ids is not None:
        check_token_ids(input_ids, config.vocab_size, past_seen)
    if isinstance(attention_mask, torch.Tensor):
        check_mask_shape(attention_mask, batch, config.num_attention_heads, past_seen, q_len)


def check_token_ids(input_ids, vocab_size, past_seen):
    # A one-token step that extends a cache feeds back the model's own prediction: skipping the check there off
    # the CPU keeps decoding free of a per-step host sync. Prompts are always checked.
    extends_cache = not isinstance(past_seen, int) or past_seen > 0  # a tensor for StaticCache
    decode_step = input_ids.shape[1] == 1 and input_ids.device.type != "cpu" and extends_cache
    if decode_step or torch.compiler.is_compiling():
        return
    out_of_range = (input_ids < 0) | (input_ids >= vocab_size)
    if out_of_range.any():
        bad = sorted(set(input_ids[out_of_range].tolist()))[:8]
        raise ValueError(
            f"input_ids contain token id(s) {bad} outside the vocabulary [0, {vocab_size}). Fix: tokenize with "
            f"this model's tokenizer, or resize_token_embeddings() after adding tokens."
        )


def check_mask_shape(attention_mask, batch, num_heads, past_seen, q_len):
    """A 2-D mask has one column per token of the whole sequence (cached ones included); a 4-D one is
    [B or 1, 1 or H, T, key length]. `past_seen` is a tensor (length unknown) for StaticCache."""
    known_len = past_seen + q_len if isinstance(past_seen, int) else None
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() == 2:
        length_ok = shape[1] == known_len if known_len is not None else shape[1] >= q_len
        ok = shape[0] == batch and length_ok
        expected = f"[{batch}, {known_len if known_len is not None else 'past + new tokens'}]"
    elif attention_mask.dim() == 4:
        ok = shape[0] in (1, batch) and shape[1] in (1, num_heads) and shape[2] == q_len
        expected = f"[{batch}, 1, {q_len}, key length]"
    else:
        ok = False
        expected = f"[{batch}, past + new tokens] (2-D) or [{batch}, 1, {q_len}, key length] (4-D)"
    if not ok:
        raise ValueError(
            f"attention_mask has shape {list(shape)} but these inputs need {expected} (batch {batch}, {q_len} new "
            f"tokens, {past_seen} cached). Fix: pass one mask column per token of the full sequence, cached tokens "
            f"included."
        )


def check_generation_mask(inputs, kwargs):
    """generate() turns a 2-D mask into position ids (and may drop it when it is all ones) before any forward
    runs: a mask of the wrong length would shift every position silently."""
    mask = kwargs.get("attention_mask")
    prompt = next(
        (t for t in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if isinstance(t, torch.Tensor)),
        None,
    )
    continues_cache = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or prompt is None or continues_cache:
        return
    if list(mask.shape) != list(prompt.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {list(mask.shape)} but the prompt is {list(prompt.shape[:2])}. Fix: pass "
            f"one mask column per prompt token (the attention_mask the tokenizer returned with these input_ids)."
        )


def safetensors_problem(path):
    """Why the safetensors file at `path` cannot be loaded in full, or None. Reads only its header: 8 bytes of
    length, JSON, then the tensors' bytes, which must end where the file ends."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            (header_len,) = struct.unpack("<Q", file.read(8))
            if 8 + header_len > size:
                return f"{size} bytes, shorter than its own header"
            header = json.loads(file.read(header_len))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as err:
        return f"unreadable header: {err}"
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + data_end != size:
        return f"{size} bytes where its header promises {8 + header_len + data_end}"
    return None


# Saved checkpoints carry `auto_map` and a copy of this file and the config's: they load with trust_remote_code
# on machines that have never seen this repo (the config names every class, see configuration_minimind.py).
MiniMindModel.register_for_auto_class("AutoModel")
MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")
for _head, _auto_class in (
    (MiniMindForSequenceClassification, "AutoModelForSequenceClassification"),
    (MiniMindForTokenClassification, "AutoModelForTokenClassification"),
    (MiniMindForQuestionAnswering, "AutoModelForQuestionAnswering"),
):
    _head.register_for_auto_class(_auto_class)
# MiniMind: the task heads build their backbone with AutoModel.from_config, which must find it without remote code.
AutoModel.register(MiniMindConfig, MiniMindModel, exist_ok=True)
# MiniMind: the Trainer shifts labels for label smoothing only for the causal LMs named in this table; listing
# ours there (also when loaded as remote code) gives Qwen3's smoothed loss.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(MiniMindConfig.model_type, MiniMindForCausalLM.__name__)

__all__ = [
    "MiniMindConfig",
    "MiniMindForCausalLM",
    "MiniMindForQuestionAnswering",
    "MiniMindPreTrainedModel",
    "MiniMindModel",
    "MiniMindForSequenceClassification",
    "MiniMindForTokenClassification",
]
