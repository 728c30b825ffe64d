"""Export to GGUF for llama.cpp (architecture qwen3 / qwen3moe, tokenizer included)."""

import json
from pathlib import Path

import torch

from minimind.export.common import _refuse, load_minimind
from minimind.export.qwen3 import _moe_layers, _stack_experts

GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# llama.cpp runs its `qwen3`/`qwen3moe` graphs with NEOX-style RoPE (rotate-half pairs (i, i + Dh/2)), which is
# the Hugging Face layout, so q_proj/k_proj are written as they are. (Its `llama` arch uses interleaved pairs,
# which is why llama exports permute Q/K.) Every `qwen3moe` layer is an MoE layer, and its router always
# renormalises the top-k weights.

_YARN_KEYS_LLAMA_CPP_COMPUTES = ("attention_factor", "mscale", "mscale_all_dim")


def check_gguf_compatible(config):
    """Raise ValueError for settings llama.cpp's qwen3 / qwen3moe graphs cannot reproduce."""
    target = "gguf"
    if not config.qk_norm:
        _refuse(target, "qk_norm", config.qk_norm, "but llama.cpp's qwen3 graph always normalises q and k")
    if config.attention_bias:
        _refuse(target, "attention_bias", config.attention_bias, "but llama.cpp's qwen3 graph loads no q/k/v/o biases")
    if config.hidden_act not in ("silu", "swish"):
        _refuse(target, "hidden_act", config.hidden_act, "but llama.cpp's qwen3 feed-forward is SwiGLU (silu)")
    if config.use_moe:
        dense = [i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)]
        if dense:
            _refuse(
                target,
                "mlp_only_layers/decoder_sparse_step",
                (config.mlp_only_layers, config.decoder_sparse_step),
                f"make layers {dense} dense, but llama.cpp's qwen3moe makes every layer an MoE layer",
            )
        if getattr(config, "n_shared_experts", 0):
            _refuse(
                target, "n_shared_experts", config.n_shared_experts, "but llama.cpp's qwen3moe has no shared experts"
            )
        if not config.norm_topk_prob:
            _refuse(
                target,
                "norm_topk_prob",
                config.norm_topk_prob,
                "but llama.cpp's qwen3moe always renormalises the top-k router weights",
            )
    rope = config.rope_parameters
    if rope["rope_type"] not in ("default", "linear", "yarn"):
        _refuse(
            target,
            "rope_parameters",
            {"rope_type": rope["rope_type"]},
            "has no GGUF key: llama.cpp's qwen3 knows plain, linear and YaRN RoPE and would run plain RoPE",
        )
    if rope["rope_type"] == "yarn":
        custom = [key for key in _YARN_KEYS_LLAMA_CPP_COMPUTES if rope.get(key) is not None]
        if custom or rope.get("truncate", True) is False:
            _refuse(
                target,
                "rope_parameters",
                {k: rope.get(k) for k in custom + ["truncate"]},
                "sets YaRN details that GGUF has no key for (llama.cpp derives the attention factor itself)",
            )


def check_qwen2_pretokenizer(tokenizer_json):
    """GGUF names the pre-tokenizer instead of storing it; claim llama.cpp's `qwen2` only if ours is exactly
    that split regex followed by a regex-free byte-level step."""
    from minimind.tokenizer import QWEN2_PRETOKENIZE_REGEX

    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    ok = (
        tokenizer_json["model"].get("type") == "BPE"
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("pattern", {}).get("Regex") == QWEN2_PRETOKENIZE_REGEX
        and steps[1].get("type") == "ByteLevel"
        and not steps[1].get("use_regex", True)
        and tokenizer_json.get("normalizer") is None
    )
    if not ok:
        raise ValueError(
            "Cannot export the tokenizer to GGUF: it is not a byte-level BPE with the Qwen2 split "
            "regex and no normaliser, so llama.cpp's 'qwen2' pre-tokenizer would split text "
            "differently. Use the tokenizer trained by minimind.tokenizer."
        )


def _gguf_token_table(tokenizer_dir, vocab_size):
    """Tokens in id order (byte-level strings as in tokenizer.json) and llama.cpp token types, padded with
    unused `[PAD{i}]` entries up to the model's embedding rows."""
    import gguf

    tokenizer_json = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    check_qwen2_pretokenizer(tokenizer_json)
    by_id = {index: token for token, index in tokenizer_json["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in tokenizer_json.get("added_tokens", [])}
    by_id.update({index: entry["content"] for index, entry in added.items()})
    if max(by_id) >= vocab_size:
        raise ValueError(
            f"The tokenizer has ids up to {max(by_id)} but the model has only vocab_size={vocab_size} "
            f"embedding rows. Fix: resize_token_embeddings() before exporting."
        )
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            # Special tokens are control tokens (never produced from text); the others (<think>, ...) are
            # user-defined: matched verbatim in text, and kept when llama.cpp detokenizes.
            types.append(gguf.TokenType.CONTROL if added[index]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _write_gguf_tokenizer(writer, tokenizer_dir, vocab_size):
    import gguf

    tokens, types = _gguf_token_table(tokenizer_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, bos/eos/pad/unk ids and the chat template, read by the gguf package from the tokenizer files.
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_bos_token(False)  # our tokenizer never inserts bos; the chat template writes the markers


def _write_gguf_hparams(writer, config):
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)  # Qwen3's head_dim need not be hidden_size / heads
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast") or 32.0))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow") or 1.0))
    if config.use_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def gguf_tensors(model):
    """(GGUF name, tensor) pairs, names from the gguf package's map for the qwen3 / qwen3moe architecture.
    Experts are stacked: ffn_{gate,up}_exps [E, I, D], ffn_down_exps [E, D, I] (torch order)."""
    import gguf

    config = model.config
    arch = gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")  # llama.cpp falls back to token_embd when `output` is absent
    hf_tensors = {key: value for key, value in state_dict.items() if ".mlp.experts." not in key}
    for i in _moe_layers(config):
        prefix = f"model.layers.{i}.mlp.experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            # The tensor map knows the stacked experts under this (transformers-4 Qwen3-MoE) name.
            hf_tensors[f"{prefix}.{proj}.weight"] = _stack_experts(state_dict, prefix, config.num_experts, proj)
    for hf_name, tensor in hf_tensors.items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"No GGUF name for tensor {hf_name!r} in architecture {gguf.MODEL_ARCH_NAMES[arch]!r}.")
        yield gguf_name, tensor


def _file_type(name):
    import gguf

    return getattr(gguf.LlamaFileType, name)


GGUF_FILE_TYPES = {
    "f32": lambda: _file_type("ALL_F32"),
    "f16": lambda: _file_type("MOSTLY_F16"),
    "bf16": lambda: _file_type("MOSTLY_BF16"),
    "q8_0": lambda: _file_type("MOSTLY_Q8_0"),
}


def _add_matrix(writer, name, array, outtype):
    """One weight matrix in `outtype`: f16 as numpy float16; bf16 and q8_0 as the gguf package's raw blocks."""
    import gguf

    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}.get(outtype)
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 1
    if qtype is None or array.shape[-1] % block:
        writer.add_tensor(name, array.astype("float16"))
        return
    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def export_gguf(model_name_or_path, output_file, tokenizer_name_or_path=None, outtype="f16"):
    """Write a GGUF file (architecture qwen3 / qwen3moe, tokenizer included); return its path.

    `outtype` f16, bf16 and q8_0 store matrices in that type but keep norms and the MoE router in float32, as
    llama.cpp's own converter does (a rounded router can flip which experts a token goes to); f32 stores
    everything in float32. q8_0 (blocks of 32 int8 values with one float16 scale, quantized by the gguf package as
    llama-quantize would) needs rows whose length is a multiple of 32; a matrix whose rows are not is stored in
    f16 instead, again as llama.cpp's converter does.
    """
    import gguf

    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"outtype must be one of {GGUF_OUTTYPES}, got {outtype!r}")
    model = load_minimind(model_name_or_path, dtype=torch.float32)
    config = model.config
    check_gguf_compatible(config)
    tokenizer_dir = Path(tokenizer_name_or_path or model_name_or_path)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ValueError(
            f"No tokenizer.json in {tokenizer_dir}: a GGUF file must carry its tokenizer. "
            f"Fix: pass the tokenizer directory (e.g. tokenizer/)."
        )

    arch = gguf.MODEL_ARCH.QWEN3MOE if config.use_moe else gguf.MODEL_ARCH.QWEN3
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(output_file, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(Path(model_name_or_path).resolve().name)
    writer.add_file_type(GGUF_FILE_TYPES[outtype]())
    _write_gguf_hparams(writer, config)
    _write_gguf_tokenizer(writer, tokenizer_dir, config.vocab_size)
    for name, tensor in gguf_tensors(model):
        array = tensor.detach().to(torch.float32).numpy()
        if outtype == "f32" or array.ndim == 1 or name.endswith(".ffn_gate_inp.weight"):
            writer.add_tensor(name, array)
        else:
            _add_matrix(writer, name, array, outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return output_file
