"""Export to ONNX (`minimind-export --to onnx`): the graph's inputs and outputs are optimum's layout, and
onnxruntime used directly (an InferenceSession, present -> past fed back by hand) gives transformers' logits for a
padded batch and exactly `generate`'s greedy tokens over 32 cached steps, dense and MoE."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import load_script, model_dir, tiny_config
from minimind.export import check_onnx_compatible, onnx_input_names, onnx_output_names

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("onnxruntime") is None,
        reason="onnxruntime is not installed (pip install 'minimind[onnx]')",
    ),
    pytest.mark.usefixtures("one_thread"),
]
MOE = dict(
    use_moe=True,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    moe_intermediate_size=32,
    tie_word_embeddings=False,
)
STEPS = 32
LOGIT_ATOL = 1e-4  # float32 through two runtimes; measured differences are ~2e-6


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{"dense"|"moe": (model directory, ONNX directory)}, each exported once through the command."""
    root = tmp_path_factory.mktemp("onnx")
    made = {}
    for kind, overrides, with_tokenizer in (("dense", {}, True), ("moe", MOE, False)):
        src, dst = root / kind, root / f"{kind}-onnx"
        model_dir(src, std=0.1, with_tokenizer=with_tokenizer, **overrides)
        load_script("export").main(["--to", "onnx", "--model_name_or_path", str(src), "--output_dir", str(dst)])
        made[kind] = src, dst
    return made


def _session(onnx_dir):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(onnx_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _load(model_dir_path):
    return AutoModelForCausalLM.from_pretrained(model_dir_path, dtype=torch.float32).eval()


def _prompt(vocab_size):
    """Two prompts of 9 tokens, the second left-padded by 3 (mask 0): padding must be honoured by the graph."""
    ids = torch.randint(3, vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def _positions(mask):
    """What generate derives from a 2-D mask: cumsum - 1, with 1 at padded positions."""
    return (np.cumsum(mask, axis=-1) - 1).clip(min=0) * mask + (1 - mask)


def _ort_greedy(session, config, ids, mask, steps):
    """Greedy decoding with onnxruntime alone: empty pasts first, then one token a step, each step's `present.*`
    fed back as `past_key_values.*`. Returns the tokens [B, steps] and each step's last logits [steps, B, V]."""
    batch, layers = ids.shape[0], config["num_hidden_layers"]
    past = [np.zeros((batch, config["num_key_value_heads"], 0, config["head_dim"]), np.float32)] * (2 * layers)
    names = onnx_input_names(layers)
    tokens, step_logits, new = [], [], ids
    for _ in range(steps):
        positions = _positions(mask)[:, -new.shape[1] :]
        logits, *past = session.run(None, dict(zip(names, [new, mask, positions, *past])))
        step_logits.append(logits[:, -1])
        new = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens.append(new)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return np.concatenate(tokens, axis=1), np.stack(step_logits)


def test_graph_has_optimum_cache_layout(exported):
    """The ONNX graph has Optimum's KV-cache layout and its files."""
    import onnx

    src, dst = exported["dense"]
    graph = onnx.load(str(dst / "model.onnx"))
    onnx.checker.check_model(graph)
    session = _session(dst)
    inputs = {i.name: (i.shape, i.type) for i in session.get_inputs()}
    outputs = {o.name: o.shape for o in session.get_outputs()}
    assert (
        list(inputs)
        == onnx_input_names(2)
        == [
            "input_ids",
            "attention_mask",
            "position_ids",
            "past_key_values.0.key",
            "past_key_values.0.value",
            "past_key_values.1.key",
            "past_key_values.1.value",
        ]
    )
    assert (
        list(outputs)
        == onnx_output_names(2)
        == ["logits"] + [f"present.{i}.{p}" for i in range(2) for p in ("key", "value")]
    )
    assert inputs["input_ids"] == (["batch_size", "sequence_length"], "tensor(int64)")
    assert inputs["attention_mask"] == (["batch_size", "past_sequence_length + sequence_length"], "tensor(int64)")
    assert inputs["past_key_values.1.value"] == (["batch_size", 2, "past_sequence_length", 16], "tensor(float)")
    assert outputs["logits"] == ["batch_size", "sequence_length", 6400]
    assert outputs["present.0.key"][:2] == ["batch_size", 2] and outputs["present.0.key"][3] == 16
    assert isinstance(outputs["present.0.key"][2], str)  # past + new: dynamic

    # config.json is transformers' Qwen3 config (what optimum's ORTModelForCausalLM reads), no remote code
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == 2
    assert AutoTokenizer.from_pretrained(dst).encode("hello") == AutoTokenizer.from_pretrained(src).encode("hello")
    moe_config = json.loads((exported["moe"][1] / "config.json").read_text())
    assert moe_config["model_type"] == "qwen3_moe" and moe_config["mlp_only_layers"] == [1]
    assert not (exported["moe"][1] / "tokenizer.json").exists()  # none in the source: none written


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_padded_prompt_logits_equal_transformers(exported, kind):
    """ONNX prompt logits equal transformers on a padded batch."""
    src, dst = exported[kind]
    model = _load(src)
    config = json.loads((dst / "config.json").read_text())
    ids, mask = _prompt(model.config.vocab_size)
    positions = _positions(mask.numpy())
    empty = np.zeros((2, config["num_key_value_heads"], 0, config["head_dim"]), np.float32)
    feed = [ids.numpy(), mask.numpy(), positions, *[empty] * (2 * config["num_hidden_layers"])]
    logits, *present = _session(dst).run(None, dict(zip(onnx_input_names(config["num_hidden_layers"]), feed)))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=torch.from_numpy(positions), use_cache=True)
    reference = out.logits.numpy()
    real = mask.numpy().astype(bool)  # padded positions' logits are meaningless in both
    difference = np.abs(logits - reference)[real].max()
    print(f"{kind}: max |logit difference| over {real.sum()} prompt positions = {difference:.2e}")
    assert difference < LOGIT_ATOL
    assert np.abs(reference).max() > 0.5  # sharp logits: a wrong mask or position would show
    assert [p.shape for p in present] == [(2, config["num_key_value_heads"], 9, config["head_dim"])] * len(present)
    # The cache the graph returns is the one transformers builds (real positions; padded ones are never read).
    cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.24 renamed the field
    for layer, (key, value) in enumerate(zip(present[::2], present[1::2])):
        for ours, theirs in ((key, cache.layers[layer].keys), (value, cache.layers[layer].values)):
            assert np.abs(ours - theirs.numpy()).transpose(0, 2, 1, 3)[real].max() < LOGIT_ATOL  # [B, S, K, Dh]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cached_greedy_tokens_equal_generate(exported, kind):
    """Greedy tokens over 32 cached steps equal generate."""
    src, dst = exported[kind]
    model = _load(src)
    ids, mask = _prompt(model.config.vocab_size)
    tokens, step_logits = _ort_greedy(
        _session(dst), json.loads((dst / "config.json").read_text()), ids.numpy(), mask.numpy(), STEPS
    )
    with torch.no_grad():
        generated = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,  # all 32 steps, whatever comes out
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = generated.sequences[:, ids.shape[1] :].numpy()
    assert expected.shape == (2, STEPS)
    difference = np.abs(step_logits - torch.stack(generated.logits).numpy()).max()
    print(f"{kind}: greedy tokens {tokens.tolist()}; max |logit difference| over {STEPS} steps = {difference:.2e}")
    np.testing.assert_array_equal(tokens, expected)
    assert difference < LOGIT_ATOL
    assert len(np.unique(tokens)) >= 4  # not one token repeated: the cache and positions are exercised


def test_refuses_length_dependent_rope():
    """ONNX refuses rope that recomputes from the sequence length."""
    with pytest.raises(ValueError, match=r"Cannot export to onnx: rope_parameters=\{'rope_type': 'dynamic'\}"):
        check_onnx_compatible(tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    check_onnx_compatible(
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    )
