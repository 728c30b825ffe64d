"""Export to transformers' native Qwen3 / Qwen3-MoE (same logits, no remote code) and to GGUF (read back
with the gguf package's reader); refusals for settings a target cannot reproduce."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TOKENIZER_DIR, load_script, model_dir, tiny_config
from minimind.export import check_gguf_compatible, check_qwen3_compatible

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason="the gguf package is not installed (pip install gguf)"
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _export(*args):
    return load_script("export").main([str(a) for a in args])


def _model_dir(path, with_tokenizer=True, std=0.1, **overrides):
    return model_dir(path, std=std, with_tokenizer=with_tokenizer, **overrides)


def _load_native(path):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=False, output_loading_info=True, dtype=torch.float32
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


# ------------------------------------------------------------------------------------------------------
# transformers Qwen3 / Qwen3-MoE
# ------------------------------------------------------------------------------------------------------


def test_qwen3_dense_yarn_same_logits(tmp_path):
    """Export Qwen3 dense YaRN same logits without remote code."""
    ours = _model_dir(tmp_path / "src", rope_scaling=YARN)
    _export("--to", "qwen3", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "dst")

    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert "auto_map" not in config
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4.0
    assert not list((tmp_path / "dst").glob("*.py"))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(tmp_path / "dst"))
    AutoTokenizer.from_pretrained(tmp_path / "dst")  # the copied tokenizer loads on its own

    theirs = _load_native(tmp_path / "dst")
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, 6400, (2, 80))  # past original_max_position_embeddings, where YaRN matters
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)


def test_qwen3_moe_with_dense_layer_same_logits(tmp_path):
    ours = _model_dir(
        tmp_path / "src",
        with_tokenizer=False,
        use_moe=True,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        moe_intermediate_size=32,
        tie_word_embeddings=False,
    )
    _export("--to", "qwen3", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "dst")

    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and "auto_map" not in config
    assert (config["intermediate_size"], config["moe_intermediate_size"], config["mlp_only_layers"]) == (96, 32, [1])
    theirs = _load_native(tmp_path / "dst")
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert type(theirs.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # the dense layer stayed dense
    ids = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)


def test_qwen3_refuses_qk_norm_false():
    with pytest.raises(ValueError, match=r"^Cannot export to qwen3: qk_norm=False but Qwen3 always applies RMSNorm"):
        check_qwen3_compatible(tiny_config(qk_norm=False))
    assert check_qwen3_compatible(tiny_config(use_moe=True, decoder_sparse_step=2, num_hidden_layers=2)) is None


def test_qwen3_refuses_shared_experts():
    with pytest.raises(ValueError, match=r"^Cannot export to qwen3: n_shared_experts=1 but Qwen3-MoE has no shared"):
        check_qwen3_compatible(tiny_config(use_moe=True, n_shared_experts=1))


# ------------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------------


def _gguf_reader(path):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return gguf, fields, tensors


def _gguf_array(tensor):
    """A tensor read back in torch's [out, in] order (GGUF lists dimensions innermost first)."""
    return np.asarray(tensor.data).reshape(tuple(int(d) for d in reversed(tensor.shape)))


@needs_gguf
def test_gguf_dense_metadata_and_tensors(tmp_path):
    """GGUF dense metadata tokenizer and tensors."""
    ours = _model_dir(tmp_path / "src", rope_scaling=YARN)
    path = _export(
        "--to", "gguf", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "out", "--outtype", "f32"
    )
    assert path == tmp_path / "out" / "src-f32.gguf"
    gguf, fields, tensors = _gguf_reader(path)
    cfg = ours.config

    assert fields["general.architecture"] == "qwen3"
    expected_kv = {
        "context_length": 256,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "rope.freq_base": 10000.0,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 64,
    }
    for key, value in expected_kv.items():
        assert fields[f"qwen3.{key}"] == pytest.approx(value), key
    assert fields["qwen3.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 6400 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokens == tokenizer.convert_ids_to_tokens(list(range(6400)))
    types = fields["tokenizer.ggml.token_type"]
    assert types[:7] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.USER_DEFINED] * 4  # <think> & co.
    assert set(types[7:]) == {gguf.TokenType.NORMAL}
    assert len(fields["tokenizer.ggml.merges"]) == len(
        json.load(open(os.path.join(TOKENIZER_DIR, "tokenizer.json")))["model"]["merges"]
    )
    assert (
        fields["tokenizer.ggml.bos_token_id"],
        fields["tokenizer.ggml.eos_token_id"],
        fields["tokenizer.ggml.padding_token_id"],
    ) == (1, 2, 0)
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 2)
    expected = {
        name_map.get_name(key, try_suffixes=(".weight",)): value
        for key, value in ours.state_dict().items()
        if key != "lm_head.weight"
    }  # tied: no `output`
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        # Values as they are: llama.cpp's qwen3 uses the HF rotate-half RoPE layout, so Q/K are not permuted.
        np.testing.assert_array_equal(_gguf_array(tensors[name]), value.numpy(), err_msg=name)


@needs_gguf
@pytest.mark.parametrize(
    "rope, expected",
    [
        (None, {}),
        ({"rope_type": "linear", "factor": 2.0}, {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    ],
    ids=["default", "linear"],
)
def test_gguf_rope_scaling_metadata(tmp_path, rope, expected):
    _model_dir(tmp_path / "src", with_tokenizer=True, rope_scaling=rope)
    path = _export("--to", "gguf", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "out")
    _, fields, _ = _gguf_reader(path)
    scaling = {key[len("qwen3.") :]: value for key, value in fields.items() if key.startswith("qwen3.rope.scaling.")}
    assert scaling == pytest.approx(expected)


@needs_gguf
def test_gguf_moe_expert_tensors_and_counts(tmp_path):
    ours = _model_dir(
        tmp_path / "src",
        use_moe=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
    )
    path = _export(
        "--to",
        "gguf",
        "--model_name_or_path",
        tmp_path / "src",
        "--output_dir",
        tmp_path / "out",
        "--outfile",
        "moe.gguf",
    )
    gguf, fields, tensors = _gguf_reader(path)
    assert fields["general.architecture"] == "qwen3moe"
    assert (
        fields["qwen3moe.expert_count"],
        fields["qwen3moe.expert_used_count"],
        fields["qwen3moe.expert_feed_forward_length"],
    ) == (4, 2, 32)

    # Every stacked expert tensor of every expert and layer. f16 storage (11-bit significand) rounds each
    # weight to within 2^-11 of its magnitude: that relative tolerance is the storage's own precision.
    shapes = {"gate": (4, 32, 64), "up": (4, 32, 64), "down": (4, 64, 32)}
    for layer_idx, layer in enumerate(ours.model.layers):
        for proj, shape in shapes.items():
            stacked = _gguf_array(tensors[f"blk.{layer_idx}.ffn_{proj}_exps.weight"])
            assert stacked.shape == shape
            for e, expert in enumerate(layer.mlp.experts):
                weight = getattr(expert, f"{proj}_proj").weight.detach().numpy()
                np.testing.assert_allclose(
                    stacked[e], weight, rtol=2**-11, atol=1e-7, err_msg=f"layer {layer_idx} expert {e} {proj}_proj"
                )
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    # The router and the norms stay f32 even in an f16 file.
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert "output.weight" in tensors  # untied head exported


# Every refusal docs/ecosystem-export.md lists, each with the field and the value in the message.
@pytest.mark.parametrize(
    "overrides, field, value",
    [
        (
            {"use_moe": True, "num_hidden_layers": 3, "mlp_only_layers": [1]},
            "mlp_only_layers/decoder_sparse_step",
            "([1], 1)",
        ),
        ({"use_moe": True, "decoder_sparse_step": 2}, "mlp_only_layers/decoder_sparse_step", "([], 2)"),
        ({"use_moe": True, "num_experts_per_tok": 2, "norm_topk_prob": False}, "norm_topk_prob", "False"),
        ({"attention_bias": True}, "attention_bias", "True"),
        ({"use_moe": True, "n_shared_experts": 2}, "n_shared_experts", "2"),
        ({"qk_norm": False}, "qk_norm", "False"),
        ({"hidden_act": "gelu"}, "hidden_act", "'gelu'"),
        (
            {"rope_scaling": {**YARN, "attention_factor": 1.0}},
            "rope_parameters",
            "{'attention_factor': 1.0, 'truncate': None}",
        ),
        (
            {"rope_scaling": {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}},
            "rope_parameters",
            "{'mscale': 0.707, 'mscale_all_dim': 1.0, 'truncate': None}",
        ),
        ({"rope_scaling": {**YARN, "truncate": False}}, "rope_parameters", "{'truncate': False}"),
    ],
    ids=lambda v: v if isinstance(v, str) and "{" not in v and "(" not in v else None,
)
def test_gguf_refuses_what_llama_cpp_cannot_run(overrides, field, value):
    """GGUF refuses settings llama.cpp cannot run."""
    with pytest.raises(ValueError) as refused:
        check_gguf_compatible(tiny_config(**overrides))
    message = str(refused.value)
    assert message.startswith(f"Cannot export to gguf: {field}={value} "), message
    assert message.endswith(". The export would not give the same outputs, so it is refused."), message


@pytest.mark.parametrize(
    "overrides", [{}, {"use_moe": True, "num_experts_per_tok": 2}, {"rope_scaling": YARN}, {"hidden_act": "swish"}]
)
def test_gguf_accepts_what_llama_cpp_runs(overrides):
    assert check_gguf_compatible(tiny_config(**overrides)) is None


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_gguf_refuses_unknown_rope_types(rope):
    """GGUF refuses rope types it has no keys for."""
    with pytest.raises(
        ValueError,
        match=rf"^Cannot export to gguf: rope_parameters={{'rope_type': "
        rf"'{rope['rope_type']}'}} has no GGUF key: llama.cpp's qwen3 knows plain, "
        r"linear and YaRN RoPE and would run plain RoPE\. The export would not",
    ):
        check_gguf_compatible(tiny_config(rope_parameters=dict(rope)))


@needs_gguf
def test_gguf_refuses_tokenizer_llama_cpp_splits(tmp_path):
    """GGUF refuses tokenizer llama.cpp would split differently."""
    from tokenizers import Tokenizer, pre_tokenizers

    _model_dir(tmp_path / "src")
    tokenizer = Tokenizer.from_file(str(tmp_path / "src" / "tokenizer.json"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 regex, not qwen2
    tokenizer.save(str(tmp_path / "src" / "tokenizer.json"))
    with pytest.raises(ValueError, match="qwen2"):
        _export("--to", "gguf", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "out")


@needs_gguf
@pytest.mark.skipif(
    os.environ.get("MINIMIND_LLAMA_CPP") != "1" or importlib.util.find_spec("llama_cpp") is None,
    reason="opt-in: set MINIMIND_LLAMA_CPP=1 with llama-cpp-python installed (pip install "
    "llama-cpp-python builds llama.cpp from source, 6-13 min on 2 cores)",
)
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        {"use_moe": True, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ],
    ids=["dense", "yarn", "moe"],
)
def test_llama_cpp_runs_gguf_like_ours(tmp_path, overrides):
    """llama.cpp runs GGUF with our tokens and greedy output."""
    import llama_cpp

    ours = _model_dir(tmp_path / "src", std=0.3, **overrides)
    path = _export(
        "--to", "gguf", "--model_name_or_path", tmp_path / "src", "--output_dir", tmp_path / "out", "--outtype", "f32"
    )
    # An f32 KV cache (llama.cpp defaults to f16) so that logits can be compared tightly.
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    text = "<|im_start|>user\nHello, world! It's 2024: naïve café 123.<|im_end|>\n<|im_start|>assistant\n"
    prompt = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert prompt == tokenizer(text)["input_ids"]  # the "qwen2" pre-tokenizer splits as ours does

    llm.eval(prompt)
    with torch.no_grad():
        logits = ours(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(llm.scores[: len(prompt)]), logits, atol=1e-3, rtol=1e-3)
    ours_greedy = ours.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    theirs_greedy = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        theirs_greedy.append(token)
        if len(theirs_greedy) == 8:
            break
    assert theirs_greedy == ours_greedy[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "overrides",
    [
        {"attention_bias": True, "rope_scaling": YARN, "tie_word_embeddings": False, "attention_dropout": 0.1},
        {
            "use_moe": True,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.123,
            "norm_topk_prob": False,
            "output_router_logits": True,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
            "moe_intermediate_size": 32,
        },
    ],
    ids=["dense", "moe"],
)
def test_qwen3_config_carries_shared_settings(overrides):
    """Qwen3 config carries every setting the two share."""
    from minimind.export import qwen3_config

    ours = tiny_config(**overrides).to_dict()
    theirs = qwen3_config(tiny_config(**overrides)).to_dict()
    bookkeeping = {"model_type", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype"}
    shared = (set(ours) & set(theirs)) - bookkeeping
    assert {"attention_bias", "rope_parameters", "head_dim", "rms_norm_eps"} <= shared
    if overrides.get("use_moe"):
        assert {"router_aux_loss_coef", "norm_topk_prob", "mlp_only_layers", "moe_intermediate_size"} <= shared
    assert {key: theirs[key] for key in shared} == {key: ours[key] for key in shared}
