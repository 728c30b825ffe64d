"""MiniMind: a Llama/Qwen3-family decoder as a transformers model.

Reads top to bottom: RoPE -> RMSNorm -> attention -> SwiGLU MLP / mixture of experts -> decoder
layer -> backbone -> causal-LM head. State-dict names equal transformers' Qwen3ForCausalLM (and
upstream MiniMind's for the experts), so weights move between the three with strict key matching.

Shapes: B batch, T new tokens, S = cached + new tokens, D hidden, H query heads, K key/value heads,
Dh head_dim, E experts, k experts per token, N = B*T tokens, V vocabulary.

This file depends on torch and transformers alone and runs under transformers 5.x and 4.57: it is
copied into every saved checkpoint. Every difference between those releases lives in the first
section.
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
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import TransformersKwargs, logging

try:  # inside a checkpoint (trust_remote_code) or the installed package
    from .configuration_minimind import MiniMindConfig
except ImportError:  # the repo root on sys.path
    from configuration_minimind import MiniMindConfig

logger = logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------------
# transformers releases: every version difference, in one place (dropping a release = deleting a
# branch)
# ------------------------------------------------------------------------------------------------

# 5.x renamed the cache keyword and output field from `past_key_values` to `cache`.
_OUTPUT_FIELDS = MoeModelOutputWithPast.__dataclass_fields__
_CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"

# create_causal_mask's cache keyword: `cache` in 5.24+, `past_key_values` in 5.17 and 4.57 (which
# also wants `cache_position`).
_MASK_PARAMS = inspect.signature(create_causal_mask).parameters
_MASK_CACHE_KEYWORD = "cache" if "cache" in _MASK_PARAMS else "past_key_values"


# 5.24+ (the releases that renamed the keyword): `past_key_values` still works but warns, as in Qwen3.
if _CACHE_FIELD == "cache":
    from transformers.utils.deprecation import deprecate_kwarg

    _deprecated_cache_keyword = deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
else:  # 5.17 and 4.57: `past_key_values` is the keyword

    def _deprecated_cache_keyword(forward):
        return forward


def _mask_kwargs(cache, position_ids, cache_position):
    kwargs = {_MASK_CACHE_KEYWORD: cache, "position_ids": position_ids}
    if "cache_position" in _MASK_PARAMS:
        kwargs["cache_position"] = cache_position
    return kwargs


# The attention kernel for a layer (`self`). `set_attn_implementation` only switches models whose
# source reads the registry in these exact words, so keep them as they are.
if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # 5.x

    def _attention_interface(self):
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)

else:  # 4.57: no get_interface and no "eager" entry

    def _attention_interface(self):
        if self.config._attn_implementation == "eager":
            return eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]


try:  # 5.x: output capturing hooks
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError:  # 4.57: the same contract under its older name
    from transformers.utils.generic import OutputRecorder
    from transformers.utils.generic import check_model_inputs as capture_outputs

# 5.x: the library's expert kernels (batched_mm, grouped_mm), chosen by `experts_implementation`.
try:
    from transformers.integrations.moe import use_experts_implementation
except ImportError:  # 4.57: MiniMind's own dispatch only

    def use_experts_implementation(experts_class):
        return experts_class


def _kernel_writes_cache(cache):
    """True for the paged cache of continuous batching in 4.57 and 5.17: their paged attention
    kernel writes it (its update() takes read/write indices), so the layer hands it over instead of
    updating it."""
    return cache is not None and not isinstance(cache, Cache) and _update_takes_indices(type(cache))


@functools.cache
def _update_takes_indices(cache_class):  # once per class: this runs in every layer of every step
    return "read_index" in inspect.signature(cache_class.update).parameters


# ------------------------------------------------------------------------------------------------
# Rotary position embedding
# ------------------------------------------------------------------------------------------------


def compute_default_rope_parameters(config, device=None, **kwargs):
    """Plain RoPE: inverse frequencies theta^(-2i/Dh) [Dh/2] in fp32, and no cos/sin scaling."""
    base, dim = config.rope_parameters["rope_theta"], config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32)
    exponents = exponents / dim
    return 1.0 / (base**exponents), 1.0


def compute_rope_parameters(config, device=None, seq_len=None, **kwargs):
    """(inv_freq [Dh/2], attention scaling) for the config's rope type. The scaled types (linear,
    dynamic, yarn, longrope, llama3) use transformers' own initialisation, so they equal Qwen3's.
    `seq_len` is the length a dynamic type has reached."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return compute_default_rope_parameters(config, device)
    if seq_len is None:
        return ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=seq_len)


class MiniMindRotaryEmbedding(nn.Module):
    """cos/sin for given positions, computed on the fly: no table to outgrow, nothing to save.

    `dynamic` and `longrope` recompute their frequencies once a sequence passes the trained length
    (transformers' `dynamic_rope_update` reads the attributes set here)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_init_fn = compute_rope_parameters  # what 4.57's dynamic_rope_update calls
        inv_freq, self.attention_scaling = compute_rope_parameters(config)
        # Non-persistent: `from_pretrained` leaves them uninitialised, so `_init_weights` recomputes
        # them.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x, position_ids):
        # position_ids [B, T] -> freqs [B, T, Dh/2], in fp32 whatever the model dtype
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, Dh]
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q [B, H, T, Dh] and k [B, K, T, Dh] by position angles (cos/sin [B, T, Dh])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ------------------------------------------------------------------------------------------------
# Norm, attention, feed-forward
# ------------------------------------------------------------------------------------------------


class MiniMindRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # Statistics in fp32 (bf16's 8-bit mantissa loses the mean of squares), scale in the input
        # dtype.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


def repeat_kv(x, n_rep):
    """[B, K, S, Dh] -> [B, K*n_rep, S, Dh]: each key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, k, s, d = x.shape
    return x[:, :, None].expand(b, k, n_rep, s, d).reshape(b, k * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Explicit attention: q [B, H, T, Dh], k/v [B, K, S, Dh], mask [B, 1, T, S] -> [B, T, H, Dh].

    The mask is additive (0 / -inf) or boolean (True = attend), as transformers' mask utilities and
    custom 4-D masks give it."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, T, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros_like(attention_mask, dtype=scores.dtype).masked_fill(
                ~attention_mask, torch.finfo(scores.dtype).min
            )
        scores = scores + attention_mask
    # Softmax in fp32: in bf16 the row sums drift and long rows lose their small weights.
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # [B, H, T, Dh]
    return out.transpose(1, 2).contiguous(), probs


class MiniMindAttention(nn.Module):
    """Grouped-query attention, per-head RMSNorm on q and k (before RoPE), registry kernel."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, cache_position=None, **kwargs
    ):
        input_shape = hidden_states.shape[:-1]  # [B, T]
        # -1: the heads (this rank's share under tensor parallelism)
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # [B,H,T,Dh]
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # [B,K,T,Dh]
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, K, T, Dh]
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

        if _kernel_writes_cache(cache):
            kwargs["cache"] = cache
        elif cache is not None:
            # The attention kwargs travel with the update: the paged cache of continuous batching
            # fills in what its kernel needs, 4.57's StaticCache reads cache_position, the other
            # caches ignore them.
            kwargs["cache_position"] = cache_position
            k, v = cache.update(k, v, self.layer_idx, kwargs)  # [B, K, S, Dh]
            del kwargs["cache_position"]

        attention_interface = _attention_interface(self)
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )  # out [B, T, H, Dh]
        out = self.o_proj(out.reshape(*input_shape, -1))  # [B, T, D]
        return out, weights


class MiniMindMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config, intermediate_size=None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


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
            # With k=1 the renormalised weight is exactly 1 and would carry no gradient to the
            # router (it would learn from the aux loss alone). Dividing by the detached value keeps
            # the value at 1 (the same numbers as Qwen3-MoE) and lets the LM loss reach the router
            # through p / stopgrad(p).
            denom = weights.sum(dim=-1, keepdim=True) if self.top_k > 1 else weights.detach()
            weights = weights / denom
        return router_logits, weights, experts


@use_experts_implementation
class MiniMindExperts(nn.ModuleList):
    """The experts, one SwiGLU MLP each (state-dict names `experts.<e>.{gate,up,down}_proj.weight`).

    The default dispatch sorts the N*k (token, expert) assignments by expert once, runs each expert
    as one matmul over its contiguous slice and scatters the weighted results back.
    `experts_implementation` "batched_mm" / "grouped_mm" runs transformers' kernels instead (no host
    sync, so they compile), over the stacked weights below."""

    def __init__(self, config):
        size = config.moe_intermediate_size
        experts = (MiniMindMLP(config, size) for _ in range(config.num_experts))
        super().__init__(experts)
        self.num_experts = config.num_experts

    @property
    def act_fn(self):  # a property, so that the list holds the experts alone
        return self[0].act_fn

    @property
    def gate_up_proj(self):  # [E, 2I, D], the layout transformers' expert kernels read
        gate = torch.stack([expert.gate_proj.weight for expert in self])
        up = torch.stack([expert.up_proj.weight for expert in self])
        return torch.cat([gate, up], dim=1)

    @property
    def down_proj(self):  # [E, D, I]
        return torch.stack([expert.down_proj.weight for expert in self])

    def forward(self, x, top_k_index, top_k_weights):
        """x [N, D], expert ids and weights [N, k] -> each token's weighted expert sum [N, D]."""
        top_k = top_k_index.shape[-1]
        flat_experts = top_k_index.reshape(-1)  # [N*k]
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert
        token_ids = order // top_k  # [N*k]: the token each sorted assignment belongs to
        # One host sync per layer for the split sizes: the price of running each expert on a dense
        # slice.
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        grouped = x[token_ids]  # [N*k, D]
        # Without autograd, experts that got no tokens are skipped (a decode step leaves most of
        # them idle); with it, every expert runs so that each gets a (zero) gradient, as optimisers
        # and DDP expect.
        expert_out = torch.cat(
            [
                expert(chunk)
                for expert, chunk in zip(self, grouped.split(counts))
                if len(chunk) or torch.is_grad_enabled()
            ]
        )  # [N*k, D]
        expert_out = expert_out * top_k_weights.reshape(-1)[order, None].to(expert_out.dtype)
        # Summed in the residual stream's dtype: under bf16 autocast the top-k outputs add up in
        # fp32, as in Qwen3-MoE.
        return x.new_zeros(x.shape).index_add_(0, token_ids, expert_out.to(x.dtype))


class MiniMindMoE(nn.Module):
    """Top-k mixture of SwiGLU experts behind a linear router."""

    def __init__(self, config):
        super().__init__()
        self.gate = MiniMindTopKRouter(config)
        self.experts = MiniMindExperts(config)

    def forward(self, hidden_states):
        batch, seq, dim = hidden_states.shape
        x = hidden_states.reshape(-1, dim)  # [N, D]
        _, weights, experts = self.gate(x)  # the logits reach the aux loss via the output recorder
        return self.experts(x, experts, weights).view(batch, seq, dim)


def load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """Switch-Transformer balance loss E * sum_e f_e * P_e over all MoE layers (k when uniform).

    f_e: share of the top-k assignments that went to expert e; P_e: mean router probability of e.
    Padding rows are left out when a matching [B, T] mask is given.
    """
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


class MiniMindDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniMindAttention(config, layer_idx)
        self.mlp = MiniMindMoE(config) if config.is_moe_layer(layer_idx) else MiniMindMLP(config)
        self.input_layernorm = MiniMindRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniMindRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, cache_position=None, **kwargs
    ):
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings,
            attention_mask,
            cache=cache,
            cache_position=cache_position,
            **kwargs,
        )
        hidden_states = hidden_states + attn_out  # [B, T, D]
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))  # [B, T, D]


# ------------------------------------------------------------------------------------------------
# Input checks: bad input fails here with a message naming the fix, not later as garbage
# ------------------------------------------------------------------------------------------------


def check_token_ids(input_ids, vocab_size, past_seen):
    # A one-token step that extends a cache feeds back the model's own prediction: skipping the
    # check there off the CPU keeps decoding free of a per-step host sync. Prompts are always
    # checked.
    extends_cache = not isinstance(past_seen, int) or past_seen > 0  # a tensor for StaticCache
    decode_step = input_ids.shape[1] == 1 and input_ids.device.type != "cpu" and extends_cache
    if decode_step or torch.compiler.is_compiling():
        return
    out_of_range = (input_ids < 0) | (input_ids >= vocab_size)
    if out_of_range.any():
        bad = sorted(set(input_ids[out_of_range].tolist()))[:8]
        raise ValueError(
            f"input_ids contain token id(s) {bad} outside the vocabulary [0, {vocab_size}). Fix: "
            f"tokenize with this model's tokenizer, or resize_token_embeddings() after adding "
            f"tokens."
        )


def check_mask_shape(attention_mask, batch, num_heads, past_seen, q_len):
    """A 2-D mask has one column per token of the whole sequence (cached ones included); a 4-D one
    is [B or 1, 1 or H, T, key length]. `past_seen` is a tensor (length unknown) for StaticCache."""
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
            f"attention_mask has shape {list(shape)} but these inputs need {expected} (batch "
            f"{batch}, {q_len} new tokens, {past_seen} cached). Fix: pass one mask column per "
            f"token of the full sequence, cached tokens included."
        )


def check_generation_mask(inputs, kwargs):
    """generate() turns a 2-D mask into position ids (and may drop it when it is all ones) before
    any forward runs: a mask of the wrong length would shift every position silently."""
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
            f"attention_mask has shape {list(mask.shape)} but the prompt is "
            f"{list(prompt.shape[:2])}. Fix: pass one mask column per prompt token (the "
            f"attention_mask the tokenizer returned with these input_ids)."
        )


def safetensors_problem(path):
    """Why the safetensors file at `path` cannot be loaded in full, or None. Reads only its
    header: 8 bytes of length, JSON, then the tensors' bytes, which must end where the file
    ends."""
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


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


class MiniMindPreTrainedModel(PreTrainedModel):
    config_class = MiniMindConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MiniMindDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flash_attn_2 = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(MiniMindTopKRouter, index=0),
        "hidden_states": MiniMindDecoderLayer,
        "attentions": MiniMindAttention,
    }

    @property
    def _can_compile_fullgraph(self):
        # Dense models have no data-dependent shapes. The default expert dispatch reads its split
        # sizes on the host; transformers' batched_mm / grouped_mm kernels do not.
        experts = getattr(self.config, "_experts_implementation", None)
        return not self.config.use_moe or experts in ("batched_mm", "grouped_mm")

    def get_correct_experts_implementation(self, requested_experts):
        # MiniMind's sorted dispatch ("eager") is the default: on CPU it beats grouped_mm.
        return super().get_correct_experts_implementation(requested_experts or "eager")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as err:
            # safetensors names neither the file nor the directory it could not read.
            folder = Path(str(pretrained_model_name_or_path))
            files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
            damaged = [f"{path} ({problem})" for path in files if (problem := safetensors_problem(path))]
            where = ", ".join(damaged) or f"a weights file of {pretrained_model_name_or_path}"
            raise OSError(
                f"{where}: the safetensors file is incomplete or damaged ({err}). Fix: "
                f"copy or download it again; a checkpoint killed mid-save is not "
                f"loadable, take an earlier one."
            ) from err

    def _init_weights(self, module):
        # torch.nn.init (not `.data`) so that transformers skips tensors already loaded from a
        # checkpoint.
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
            device = module.inv_freq.device
            inv_freq, module.attention_scaling = compute_rope_parameters(module.config, device)
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

    @_deprecated_cache_keyword
    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MiniMind needs exactly one of input_ids or inputs_embeds.")
        kwargs.pop("cache_position", None)  # from 4.57's generate; recomputed below
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) per layer
            cache = DynamicCache(cache)
        if use_cache is None:  # a training forward would only fill a cache nobody reads
            use_cache = self.config.use_cache and not (self.training and torch.is_grad_enabled())
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # recomputation would write every layer's keys into the cache twice
        fresh_cache = use_cache and cache is None
        if fresh_cache:
            cache = DynamicCache(config=self.config)

        batch, q_len = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if q_len == 0:
            raise ValueError(
                "MiniMind got an empty sequence (0 tokens). Fix: pass at least one "
                "token, e.g. the tokenizer's bos_token_id as the prompt."
            )
        # The paged cache of continuous batching is no `Cache`: it brings its own positions and
        # masks.
        past_seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size, past_seen)
        if isinstance(attention_mask, torch.Tensor):
            heads = self.config.num_attention_heads
            check_mask_shape(attention_mask, batch, heads, past_seen, q_len)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [B, T, D]

        # arange + offset (not arange(offset, ...)): the offset is a tensor for StaticCache, and
        # this form keeps torch.compile(fullgraph=True) free of unbacked symbols.
        cache_position = torch.arange(q_len, device=inputs_embeds.device) + past_seen
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)  # [1, T]
            self._warn_past_trained_length(past_seen, q_len)
        elif position_ids.shape[-1] != q_len:
            # generate() derives position ids from the 2-D mask, so there a mask of the wrong
            # length lands here rather than as a shape error deep inside RoPE.
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} tokens but the input has {q_len}. "
                f"Fix: pass one position per input token; with generate(), pass an attention_mask "
                f"with one column per prompt token (the one the tokenizer returned)."
            )

        # A cache made here is still empty, so the mask needs none; without one, create_causal_mask
        # finds packed rows (restarting position_ids) and keeps attention inside each. The paged
        # kernel of continuous batching brings its own mask.
        mask_cache = None if fresh_cache or _kernel_writes_cache(cache) else cache
        mask = create_causal_mask(
            self.config, inputs_embeds, attention_mask, **_mask_kwargs(mask_cache, position_ids, cache_position)
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)  # cos, sin [B|1, T, Dh]
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=mask,
                cache=cache,
                cache_position=cache_position,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return MoeModelOutputWithPast(last_hidden_state=hidden_states, **{_CACHE_FIELD: cache if use_cache else None})

    def _warn_past_trained_length(self, past_seen, q_len):
        # RoPE runs past the trained length (and `dynamic` scaling exists for exactly that), so
        # longer sequences run, as in Qwen3; the warning says what to expect. Packed rows bring
        # their own position_ids and never get here.
        if isinstance(past_seen, int) and past_seen + q_len > self.config.max_position_embeddings:
            limit = self.config.max_position_embeddings
            logger.warning_once(  # no length in the message, so it is logged once per process
                f"A sequence is longer than max_position_embeddings={limit}; quality may drop past "
                f"the trained length. RoPE scaling (rope_parameters with rope_type 'dynamic' or "
                f"'yarn') extends the context."
            )


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    """The backbone plus a (tied by default) LM head: logits [B, T, V], shifted-label loss, MoE aux
    loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config):
        super().__init__(config)
        self.model = MiniMindModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @_deprecated_cache_keyword
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_router_logits=None,
        return_dict=None,
        logits_to_keep=0,
        cache=None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast | tuple:
        """`labels` [B, T] are the input ids themselves (-100 = ignore); the loss shifts them. With
        an int `logits_to_keep`, the loss covers the kept last positions (labels cut to match)."""
        config = self.config
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        if output_router_logits is None:  # a dense config has no such field
            output_router_logits = getattr(config, "output_router_logits", False)
        want_aux = config.use_moe and (labels is not None or output_router_logits)
        # Trainer passes `num_items_in_batch` among the kwargs: it goes to the loss, not to the
        # backbone.
        loss_keys = ("num_items_in_batch", "ignore_index", "shift_labels")
        loss_kwargs = {key: kwargs.pop(key) for key in loss_keys if key in kwargs}
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=want_aux,
            return_dict=True,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state  # [B, T, D]
        if isinstance(logits_to_keep, int):
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        else:
            keep = logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # [B, T_kept, V]

        loss = aux_loss = None
        if labels is not None:
            labels = self._labels_for(labels, logits, logits_to_keep)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **loss_kwargs)
        if want_aux:
            aux_loss = load_balancing_loss(
                outputs.router_logits, config.num_experts, config.num_experts_per_tok, attention_mask
            )
            if loss is not None and aux_loss is not None:
                loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)

        out = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits if want_aux else None,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
        )
        return out if return_dict else out.to_tuple()

    def generate(self, inputs=None, *args, **kwargs):
        check_generation_mask(inputs, kwargs)
        return super().generate(inputs, *args, **kwargs)

    @staticmethod
    def _labels_for(labels, logits, logits_to_keep):
        if labels.shape[1] == logits.shape[1]:
            return labels
        if not isinstance(logits_to_keep, int):
            raise ValueError(
                "labels with a tensor logits_to_keep are ambiguous. Fix: pass an int "
                "logits_to_keep, or labels already aligned to the kept positions."
            )
        return labels[:, -logits.shape[1] :]


# Saved checkpoints carry `auto_map` and a copy of this file and the config's: they load with
# trust_remote_code on machines that have never seen this repo.
MiniMindModel.register_for_auto_class("AutoModel")
MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["MiniMindConfig", "MiniMindPreTrainedModel", "MiniMindModel", "MiniMindForCausalLM"]
