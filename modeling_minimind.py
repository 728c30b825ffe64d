"""MiniMind: a Llama/Qwen3-family decoder as a transformers model.

Reads top to bottom: RoPE -> RMSNorm -> attention -> SwiGLU MLP / mixture of experts -> decoder layer ->
backbone -> causal-LM head. State-dict names equal transformers' Qwen3ForCausalLM (and upstream MiniMind's
for the experts), so weights move between the three with strict key matching.

Shapes: B batch, T new tokens, S = cached + new tokens, D hidden, H query heads, K key/value heads,
Dh head_dim, E experts, N = B*T tokens, V vocabulary.

This file depends on torch and transformers alone and runs under transformers 5.x and 4.57: it is copied
into every saved checkpoint. Where the two versions differ, the branch says so.
"""

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

try:  # inside a checkpoint (trust_remote_code) or the installed package
    from .configuration_minimind import MiniMindConfig
except ImportError:  # the repo root on sys.path
    from configuration_minimind import MiniMindConfig

# transformers 5 renamed the cache keyword and output field from `past_key_values` to `cache`.
_CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"
# create_causal_mask's keywords moved across versions: 4.57 takes `cache_position` and `past_key_values`, earlier
# 5.x (5.17) `past_key_values` alone, later 5.x (5.24) `cache`.
_MASK_PARAMS = inspect.signature(create_causal_mask).parameters
_MASK_CACHE_KEYWORD = "cache" if "cache" in _MASK_PARAMS else "past_key_values"


def _kernel_writes_cache(cache):
    """True for the paged cache of continuous batching in 4.57 and earlier 5.x (5.17): the paged attention kernel
    writes it (its update() takes read/write indices), so the layer hands it over instead of updating it. Later
    5.x paged caches are updated by the layer, like every `Cache`."""
    return cache is not None and not isinstance(cache, Cache) and _update_takes_indices(type(cache))


@functools.cache
def _update_takes_indices(cache_class):  # once per class: this runs in every layer of every decoding step
    return "read_index" in inspect.signature(cache_class.update).parameters


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding
# ----------------------------------------------------------------------------------------------------------

def compute_rope_inv_freq(config, device=None):
    """Inverse frequencies [Dh/2] (fp32) and the cos/sin scale for the config's RoPE type.

    YaRN follows transformers' own YaRN init exactly (same correction range, ramp and attention factor), so
    a YaRN checkpoint gives the same logits here and in Qwen3ForCausalLM.
    """
    rope = config.rope_parameters
    base, dim = rope["rope_theta"], config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = rope["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    factor = rope["factor"]
    if rope_type == "linear":
        return inv_freq / factor, 1.0

    # YaRN: keep high frequencies (fast rotations) as they are, interpolate low ones by `factor`, and blend
    # linearly over the dimensions in between.
    original_max = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_for_rotations(num_rotations):
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv_freq, float(attention_factor)


class MiniMindRotaryEmbedding(nn.Module):
    """cos/sin for given positions, computed on the fly: no table to outgrow and nothing to save."""

    def __init__(self, config):
        super().__init__()
        inv_freq, self.attention_scaling = compute_rope_inv_freq(config)
        # Non-persistent: `from_pretrained` leaves it uninitialised, so `_init_weights` recomputes it.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        # position_ids [B, T] -> freqs [B, T, Dh/2], in fp32 whatever the model dtype
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, Dh]
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """Rotate q [B, H, T, Dh] and k [B, K, T, Dh] by their positions' angles (cos/sin [B, T, Dh])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# ----------------------------------------------------------------------------------------------------------
# Norm, attention, feed-forward
# ----------------------------------------------------------------------------------------------------------

class MiniMindRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # Statistics in fp32 (bf16's 8-bit mantissa loses the mean of squares), scale in the input dtype.
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
    """Explicit attention: q [B, H, T, Dh], k/v [B, K, S, Dh], additive mask [B, 1, T, S] -> [B, T, H, Dh]."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, T, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:  # True = attend
            attention_mask = torch.zeros_like(attention_mask, dtype=scores.dtype).masked_fill(
                ~attention_mask, torch.finfo(scores.dtype).min)
        scores = scores + attention_mask
    # Softmax in fp32: in bf16 the row sums drift and long rows lose their small weights.
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # [B, H, T, Dh]
    return out.transpose(1, 2).contiguous(), probs


class MiniMindAttention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (before RoPE), kernel from the registry."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = MiniMindRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, cache_position=None,
                **kwargs):
        batch, q_len, _ = hidden_states.shape  # [B, T, D]
        q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, q_len, -1, self.head_dim).transpose(1, 2)
        # q [B, H, T, Dh], k/v [B, K, T, Dh]
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if _kernel_writes_cache(cache):
            kwargs["cache"] = cache
        elif cache is not None:
            # The attention kwargs travel with the update: the paged cache of continuous batching fills in what
            # its kernel needs, 4.57's StaticCache reads cache_position, the other caches ignore them.
            kwargs["cache_position"] = cache_position
            k, v = cache.update(k, v, self.layer_idx, kwargs)  # [B, K, S, Dh]
            del kwargs["cache_position"]

        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward)
        else:  # transformers 4.57 has no get_interface and no "eager" entry
            attention_interface = (eager_attention_forward if self.config._attn_implementation == "eager"
                                   else ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation])
        out, weights = attention_interface(
            self, q, k, v, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )  # out [B, T, H, Dh]
        return self.o_proj(out.reshape(batch, q_len, -1)), weights  # [B, T, D]


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


class MiniMindMoE(nn.Module):
    """Top-k mixture of SwiGLU experts behind a linear router.

    Tokens are dispatched grouped per expert: the N*k (token, expert) assignments are sorted by expert once,
    each expert runs one matmul over its contiguous slice, and the weighted results are scattered back.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MiniMindMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))

    def route(self, x):
        """x [N, D] -> router logits [N, E], top-k weights [N, k] (fp32), top-k expert ids [N, k]."""
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            # With k=1 the renormalised weight is exactly 1 and would carry no gradient to the router (so it
            # would learn from the aux loss alone). Dividing by the detached value keeps the value at 1 (the
            # same numbers as Qwen3-MoE) and lets the LM loss reach the router through p / stopgrad(p).
            denom = weights.sum(dim=-1, keepdim=True) if self.top_k > 1 else weights.detach()
            weights = weights / denom
        return router_logits, weights, experts

    def forward(self, hidden_states):
        batch, seq, dim = hidden_states.shape
        x = hidden_states.reshape(-1, dim)  # [N, D]
        router_logits, weights, experts = self.route(x)

        flat_experts = experts.reshape(-1)  # [N*k]
        order = flat_experts.argsort(stable=True)  # assignments grouped by expert
        token_ids = order // self.top_k  # [N*k], which token each sorted assignment belongs to
        # One host sync per layer for the split sizes: the price of running each expert on a dense slice.
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        grouped = x[token_ids]  # [N*k, D]
        # Without autograd, experts that got no tokens are skipped (a decode step leaves most of them idle); with
        # it, every expert runs so that each one gets a (zero) gradient, as optimisers and DDP expect.
        expert_out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, grouped.split(counts))
                                if len(chunk) or torch.is_grad_enabled()])
        expert_out = expert_out * weights.reshape(-1)[order, None].to(expert_out.dtype)
        # Summed in the residual stream's dtype: under bf16 autocast the top-k outputs add up in fp32, as in Qwen3-MoE.
        out = x.new_zeros(x.shape).index_add_(0, token_ids, expert_out.to(x.dtype))  # [N, D]
        return out.view(batch, seq, dim), router_logits


def load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
    """Switch-Transformer balance loss E * sum_e f_e * P_e over all MoE layers (1.0 times k when uniform).

    f_e: share of the top-k assignments that went to expert e; P_e: mean router probability of e.
    Padding rows are left out when a matching [B, T] mask is given.
    """
    if not router_logits:
        return None
    logits = torch.cat([layer.float() for layer in router_logits], dim=0)  # [L*N, E]
    probs = F.softmax(logits, dim=-1)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(dim=1).float()  # [L*N, E]
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

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                cache_position=None, **kwargs):
        attn_out, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache=cache,
            cache_position=cache_position, **kwargs)
        hidden_states = hidden_states + attn_out  # [B, T, D]
        mlp_out = self.mlp(self.post_attention_layernorm(hidden_states))
        router_logits = None
        if isinstance(mlp_out, tuple):
            mlp_out, router_logits = mlp_out
        return hidden_states + mlp_out, attn_weights, router_logits  # [B, T, D]


def _check_mask_shape(attention_mask, batch, past_seen, q_len):
    """A 2-D mask has one column per token of the whole sequence (cached ones included); a 4-D one is
    [B or 1, 1, T, key length]. `past_seen` is a tensor (length unknown here) for StaticCache."""
    known_len = past_seen + q_len if isinstance(past_seen, int) else None
    if attention_mask.dim() == 2:
        ok = attention_mask.shape[0] == batch and (
            attention_mask.shape[1] == known_len if known_len is not None else attention_mask.shape[1] >= q_len)
        expected = f"[{batch}, {known_len if known_len is not None else 'past + new tokens'}]"
    elif attention_mask.dim() == 4:
        ok = attention_mask.shape[0] in (1, batch) and attention_mask.shape[2] == q_len
        expected = f"[{batch}, 1, {q_len}, key length]"
    else:
        ok, expected = False, f"[{batch}, past + new tokens] (2-D) or [{batch}, 1, {q_len}, key length] (4-D)"
    if not ok:
        raise ValueError(
            f"attention_mask has shape {list(attention_mask.shape)} but these inputs need {expected} "
            f"(batch {batch}, {q_len} new tokens, {past_seen} cached). Fix: pass one mask column per "
            f"token of the full sequence, cached tokens included.")


# ----------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------

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
    _can_compile_fullgraph = False  # the MoE dispatch has data-dependent split sizes

    def _init_weights(self, module):
        # torch.nn.init (not `.data`) so that transformers skips tensors already loaded from a checkpoint.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, MiniMindRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, MiniMindRotaryEmbedding):
            # Non-persistent buffers come back as uninitialised memory from `from_pretrained` (5.x).
            inv_freq, module.attention_scaling = compute_rope_inv_freq(self.config, module.inv_freq.device)
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)


class MiniMindModel(MiniMindPreTrainedModel):
    """Embeddings, the decoder layers and the final norm: input ids [B, T] -> hidden states [B, T, D]."""

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

    def _check_inputs(self, input_ids, inputs_embeds, attention_mask, past_seen, q_len):
        """Bad input fails here with a message naming the fix, not later as a device assert or garbage."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MiniMind needs exactly one of input_ids or inputs_embeds.")
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        if input_ids is not None:
            self._check_token_ids(input_ids, past_seen, q_len)
        if isinstance(attention_mask, torch.Tensor):
            _check_mask_shape(attention_mask, batch, past_seen, q_len)
        if isinstance(past_seen, int) and past_seen + q_len > self.config.max_position_embeddings:
            raise ValueError(
                f"Sequence of {past_seen + q_len} tokens exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}. Fix: shorten the input, or extend the context with "
                f"rope_scaling (e.g. inference_rope_scaling=True for YaRN) and a larger max_position_embeddings.")

    def _check_token_ids(self, input_ids, past_seen, q_len):
        # A one-token step that extends a cache feeds back the model's own prediction: skipping the check there
        # off the CPU keeps decoding free of a per-step host sync. Prompts are always checked.
        decode_step = (q_len == 1 and input_ids.device.type != "cpu"
                       and (not isinstance(past_seen, int) or past_seen > 0))  # a tensor for StaticCache
        if decode_step or not input_ids.numel() or torch.compiler.is_compiling():
            return
        out_of_range = (input_ids < 0) | (input_ids >= self.config.vocab_size)
        if out_of_range.any():
            raise ValueError(
                f"input_ids contain token id(s) {sorted(set(input_ids[out_of_range].tolist()))[:8]} outside the "
                f"vocabulary [0, {self.config.vocab_size}). Fix: tokenize with this model's tokenizer, or "
                f"resize_token_embeddings() after adding tokens.")

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                output_router_logits=None, return_dict=None, cache=None, **kwargs):
        cfg = self.config
        output_attentions = output_attentions if output_attentions is not None else cfg.output_attentions
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else cfg.output_hidden_states)
        if use_cache is None:  # a training forward would only fill a cache nobody reads
            use_cache = cfg.use_cache and not (self.training and torch.is_grad_enabled())
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # recomputation would write every layer's keys into the cache twice
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) per layer
            cache = DynamicCache(cache)
        if use_cache and cache is None:
            cache = DynamicCache(config=cfg)
        kwargs.pop("cache_position", None)  # passed by 4.57's generate; recomputed below for both versions

        q_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        # The paged cache of continuous batching is no `Cache`: it comes with its own position_ids and masks.
        past_seen = cache.get_seq_length() if isinstance(cache, Cache) else 0
        self._check_inputs(input_ids, inputs_embeds, attention_mask, past_seen, q_len)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [B, T, D]
        # arange + offset (not arange(offset, ...)): the offset is a tensor for StaticCache, and this form
        # keeps torch.compile(fullgraph=True) free of unbacked symbols.
        cache_position = torch.arange(q_len, device=inputs_embeds.device) + past_seen
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)  # [1, T]

        mask_cache = None if _kernel_writes_cache(cache) else cache  # that kernel brings its own mask
        mask_kwargs = {_MASK_CACHE_KEYWORD: mask_cache, "position_ids": position_ids}
        if "cache_position" in _MASK_PARAMS:
            mask_kwargs["cache_position"] = cache_position
        mask = create_causal_mask(cfg, inputs_embeds, attention_mask, **mask_kwargs)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)  # cos, sin [B|1, T, Dh]
        all_hidden, all_attn, all_router = [], [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden_states)
            hidden_states, attn_weights, router_logits = layer(
                hidden_states, position_embeddings=position_embeddings, attention_mask=mask, cache=cache,
                cache_position=cache_position, position_ids=position_ids, **kwargs)
            all_attn.append(attn_weights)
            if router_logits is not None:
                all_router.append(router_logits)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)

        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
            router_logits=tuple(all_router) if output_router_logits and all_router else None,
            **{_CACHE_FIELD: cache if use_cache else None},
        )


class MiniMindForCausalLM(MiniMindPreTrainedModel, GenerationMixin):
    """The backbone plus a (by default tied) LM head: logits [B, T, V], shifted-label loss, MoE aux loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

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

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, output_router_logits=None, return_dict=None, logits_to_keep=0,
                cache=None, **kwargs):
        """`labels` [B, T] are the input ids themselves (-100 = ignore); the shift happens in the loss.
        With an int `logits_to_keep`, the loss covers the kept last positions (labels are cut to match)."""
        cfg = self.config
        return_dict = return_dict if return_dict is not None else getattr(cfg, "return_dict", True)
        want_aux = cfg.use_moe and (labels is not None or output_router_logits or
                                    (output_router_logits is None and cfg.output_router_logits))
        # Trainer passes `num_items_in_batch` among the kwargs: it goes to the loss, not to the backbone.
        loss_kwargs = {key: kwargs.pop(key) for key in ("num_items_in_batch", "ignore_index", "shift_labels")
                       if key in kwargs}
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            output_router_logits=want_aux, **kwargs)

        hidden_states = outputs.last_hidden_state  # [B, T, D]
        if isinstance(logits_to_keep, int):
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        else:
            keep = logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])  # [B, T_kept, V]

        loss = aux_loss = None
        if labels is not None:
            if labels.shape[1] != logits.shape[1]:
                if not isinstance(logits_to_keep, int):
                    raise ValueError("labels with a tensor logits_to_keep are ambiguous. Fix: pass an int "
                                     "logits_to_keep, or labels already aligned to the kept positions.")
                labels = labels[:, -logits.shape[1]:]
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=cfg.vocab_size, **loss_kwargs)
        if want_aux:
            aux_loss = load_balancing_loss(outputs.router_logits, cfg.num_experts, cfg.num_experts_per_tok,
                                           attention_mask)
            if loss is not None and aux_loss is not None:
                loss = loss + cfg.router_aux_loss_coef * aux_loss.to(loss.device)

        out = MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, router_logits=outputs.router_logits,
            **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
        )
        return out if return_dict else out.to_tuple()


# Saved checkpoints carry `auto_map` and a copy of this file and the config's: they load with
# trust_remote_code on machines that have never seen this repo.
MiniMindModel.register_for_auto_class("AutoModel")
MiniMindForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["MiniMindConfig", "MiniMindPreTrainedModel", "MiniMindModel", "MiniMindForCausalLM"]
