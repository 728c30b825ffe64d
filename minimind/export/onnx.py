"""Export to ONNX with a KV cache, in the layout of optimum's Qwen3 ONNX exports (and ONNX Runtime's generation
tools): inputs `input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key` / `.value`; outputs
`logits`, `present.{i}.key` / `.value`. Every axis that changes between calls is dynamic; a first step feeds
pasts of length 0.

The graph comes from torch.onnx's dynamo exporter (torch.export, then onnxscript) run on a small wrapper that
takes and returns the cache as flat tensors. Under torch.export the MoE experts take MiniMind's compiled path
(every expert on every token, weighted by the router; no host sync), so dense and MoE models export alike.
"""

import inspect
import warnings
from pathlib import Path

import torch

from minimind.export.common import _refuse, copy_tokenizer_files, load_minimind

ONNX_FILE = "model.onnx"
ONNX_OPSET = 18
# Example shapes for tracing: none of them 0 or 1, which torch.export would specialise on.
_TRACE_BATCH, _TRACE_NEW, _TRACE_PAST = 2, 3, 4
# Past 2 GB an ONNX file cannot hold its weights (protobuf): they go to a `model.onnx_data` file beside it.
_EXTERNAL_DATA_BYTES = 1_800_000_000


def onnx_input_names(num_layers):
    kv = [f"past_key_values.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *kv]


def onnx_output_names(num_layers):
    return ["logits", *[f"present.{i}.{part}" for i in range(num_layers) for part in ("key", "value")]]


def check_onnx_compatible(config):
    """Raise ValueError for settings a fixed graph cannot reproduce."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type in ("dynamic", "longrope"):
        _refuse(
            "onnx",
            "rope_parameters",
            {"rope_type": rope_type},
            "recomputes its frequencies from the sequence length at run time, which the traced graph would fix "
            "at the example's length",
        )


class OnnxCausalLM(torch.nn.Module):
    """MiniMind as a function of flat tensors: (input_ids, attention_mask, position_ids, k0, v0, k1, v1, ...)
    -> (logits, present k0, v0, ...), each k/v [B, K, S, Dh]; what torch.onnx traces."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.num_layers = model.config.num_hidden_layers
        # transformers 5.24 names the forward's cache argument `cache`, earlier releases `past_key_values`.
        self.cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self.cache_keyword: cache},
        ).logits
        present = [t for layer in cache.layers[: self.num_layers] for t in (layer.keys, layer.values)]
        return (logits, *present)


def _example_inputs(config):
    b, t, p = _TRACE_BATCH, _TRACE_NEW, _TRACE_PAST
    kv = torch.zeros(b, config.num_key_value_heads, p, config.head_dim)
    return (
        torch.randint(0, config.vocab_size, (b, t), generator=torch.Generator().manual_seed(0)),
        torch.ones(b, p + t, dtype=torch.int64),
        torch.arange(p, p + t).expand(b, t).contiguous(),
        *[kv.clone() for _ in range(2 * config.num_hidden_layers)],
    )


def _dynamic_shapes(num_layers):
    new = {0: "batch_size", 1: "sequence_length"}
    past = {0: "batch_size", 2: "past_sequence_length"}
    return (new, {0: "batch_size", 1: "past_sequence_length + sequence_length"}, new, (past,) * (2 * num_layers))


def onnx_export_config(config):
    """The config.json written next to the graph: transformers' Qwen3 / Qwen3-MoE config where it describes the
    model (optimum's ORTModelForCausalLM reads it), MiniMind's own otherwise (qk_norm=False)."""
    from minimind.export.qwen3 import qwen3_config

    try:
        return qwen3_config(config)
    except ValueError:
        return config


def export_onnx(model_name_or_path, output_dir, tokenizer_name_or_path=None, opset=ONNX_OPSET):
    """Write `model.onnx` (float32, KV-cache inputs and outputs), config.json, generation_config.json and the
    tokenizer files to `output_dir`; return the graph's path. With onnxruntime installed, the graph's logits
    are compared with the PyTorch model's before returning (`check_onnx_logits`)."""
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError as err:
            raise ImportError(
                f"Exporting to ONNX needs the {package} package (torch.onnx's exporter). Fix: pip install "
                f"'minimind[onnx]' (onnx, onnxscript, onnxruntime)."
            ) from err
    model = load_minimind(model_name_or_path, dtype=torch.float32)
    config = model.config
    check_onnx_compatible(config)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    wrapper = OnnxCausalLM(model).eval()
    layers = config.num_hidden_layers
    from minimind.decode.compiled import BUILD_LOCK  # tracing takes turns with a decode step being compiled

    with BUILD_LOCK, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on axis names and deprecated pytree classes
        program = torch.onnx.export(
            wrapper,
            _example_inputs(config),
            dynamo=True,
            opset_version=opset,
            input_names=onnx_input_names(layers),
            output_names=onnx_output_names(layers),
            dynamic_shapes=_dynamic_shapes(layers),
            verbose=False,
        )
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    path = output_dir / ONNX_FILE
    program.save(path, external_data=size > _EXTERNAL_DATA_BYTES)
    onnx_export_config(config).save_pretrained(output_dir)
    model.generation_config.save_pretrained(output_dir)
    copy_tokenizer_files(tokenizer_name_or_path or model_name_or_path, output_dir)
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return path
    difference = check_onnx_logits(path, model)
    if not difference <= 1e-3:
        raise RuntimeError(
            f"The exported graph {path} gives logits up to {difference:.3g} away from the PyTorch model's: the "
            f"export is wrong, do not use it."
        )
    return path


def check_onnx_logits(path, model, prompt_len=8, steps=2):
    """The largest |logit difference| between an onnxruntime session of the graph at `path` and `model`, over a
    prompt fed with empty pasts, then `steps` one-token steps through the cache."""
    import numpy as np
    import onnxruntime

    config = model.config
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, prompt_len + steps), generator=generator)
    empty = np.zeros((1, config.num_key_value_heads, 0, config.head_dim), np.float32)
    past = [empty] * (2 * config.num_hidden_layers)
    names = onnx_input_names(config.num_hidden_layers)
    worst, start = 0.0, 0
    with torch.no_grad():
        reference = model(input_ids=ids).logits.numpy()
    for end in [prompt_len, *range(prompt_len + 1, prompt_len + steps + 1)]:
        inputs = [ids[:, start:end].numpy(), np.ones((1, end), np.int64), np.arange(start, end)[None], *past]
        logits, *past = session.run(None, dict(zip(names, inputs)))
        worst = max(worst, float(np.abs(logits - reference[:, start:end]).max()))
        start = end
    return worst
