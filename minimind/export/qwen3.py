"""Export to transformers' own Qwen3ForCausalLM / Qwen3MoeForCausalLM: a config translation plus, for MoE,
fusing the per-expert weights into the stacked tensors transformers 5 holds."""

from pathlib import Path

import torch

from minimind.export.common import _refuse, copy_tokenizer_files, load_minimind


def check_qwen3_compatible(config):
    """Raise ValueError for settings transformers' Qwen3 / Qwen3-MoE classes cannot reproduce."""
    if not config.qk_norm:
        _refuse(
            "qwen3",
            "qk_norm",
            config.qk_norm,
            "but Qwen3 always applies RMSNorm to q and k per head "
            "(a norm with weight 1 still normalises, so it cannot be switched off by weights)",
        )
    if getattr(config, "n_shared_experts", 0):
        _refuse("qwen3", "n_shared_experts", config.n_shared_experts, "but Qwen3-MoE has no shared experts")
    # Qwen3-MoE uses the same layer rule (mlp_only_layers, decoder_sparse_step) and gives dense layers
    # `intermediate_size`, experts `moe_intermediate_size`, as MiniMind does: nothing else to refuse.


def qwen3_config(config):
    """The Qwen3Config (dense) or Qwen3MoeConfig equivalent of a MiniMindConfig."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    check_qwen3_compatible(config)
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    if not config.use_moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.output_router_logits,
        decoder_sparse_step=config.decoder_sparse_step,
        mlp_only_layers=list(config.mlp_only_layers),
    )


def _moe_layers(config):
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def _stack_experts(state_dict, prefix, num_experts, proj):
    return torch.stack([state_dict[f"{prefix}.{e}.{proj}.weight"] for e in range(num_experts)])


def fuse_experts(state_dict, config):
    """Per-expert Linear weights -> transformers 5's fused Qwen3-MoE tensors:
    `experts.gate_up_proj` [E, 2I, D] (gate rows first, then up) and `experts.down_proj` [E, D, I]."""
    fused = {key: value for key, value in state_dict.items() if ".mlp.experts." not in key}
    for i in _moe_layers(config):
        prefix = f"model.layers.{i}.mlp.experts"
        gate = _stack_experts(state_dict, prefix, config.num_experts, "gate_proj")  # [E, I, D]
        up = _stack_experts(state_dict, prefix, config.num_experts, "up_proj")  # [E, I, D]
        fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{prefix}.down_proj"] = _stack_experts(state_dict, prefix, config.num_experts, "down_proj")
    return fused


def to_qwen3_model(model):
    """A transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM holding `model`'s weights (strict load)."""
    from transformers import AutoModelForCausalLM

    native = AutoModelForCausalLM.from_config(qwen3_config(model.config), dtype=model.dtype)
    state_dict = model.state_dict()
    # transformers 5 holds Qwen3-MoE experts fused; 4.57 holds a ModuleList with MiniMind's own names.
    if any(key.endswith(".mlp.experts.gate_up_proj") for key in native.state_dict()):
        state_dict = fuse_experts(state_dict, model.config)
    native.load_state_dict(state_dict, strict=True)
    native.generation_config = model.generation_config
    return native.eval()


def export_qwen3(model_name_or_path, output_dir, tokenizer_name_or_path=None):
    """Write a native transformers checkpoint (model_type qwen3 / qwen3_moe, no auto_map, no .py files)
    plus the tokenizer; return the output directory."""
    native = to_qwen3_model(load_minimind(model_name_or_path))
    native.save_pretrained(output_dir)
    copy_tokenizer_files(tokenizer_name_or_path or model_name_or_path, output_dir)
    return Path(output_dir)
