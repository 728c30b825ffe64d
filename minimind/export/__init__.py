"""Export a MiniMind checkpoint to formats that need no MiniMind code: transformers' own Qwen3 / Qwen3-MoE
classes (`qwen3`), GGUF for llama.cpp (`gguf`) and ONNX with a KV cache for ONNX Runtime and optimum (`onnx`).

MiniMind's state-dict names already are Qwen3's, so the export is a config translation plus, for MoE, fusing
the per-expert weights into the stacked tensors the target expects. Anything the target cannot reproduce
exactly is refused up front with a ValueError naming the field, never exported approximately.
"""

from minimind.export.common import TOKENIZER_FILES, _refuse, copy_tokenizer_files, load_minimind
from minimind.export.gguf import (
    GGUF_FILE_TYPES,
    GGUF_OUTTYPES,
    check_gguf_compatible,
    check_qwen2_pretokenizer,
    export_gguf,
    gguf_tensors,
)
from minimind.export.onnx import (
    ONNX_FILE,
    OnnxCausalLM,
    check_onnx_compatible,
    check_onnx_logits,
    export_onnx,
    onnx_input_names,
    onnx_output_names,
)
from minimind.export.qwen3 import check_qwen3_compatible, export_qwen3, fuse_experts, qwen3_config, to_qwen3_model

__all__ = [
    "GGUF_FILE_TYPES",
    "GGUF_OUTTYPES",
    "ONNX_FILE",
    "TOKENIZER_FILES",
    "OnnxCausalLM",
    "_refuse",
    "check_gguf_compatible",
    "check_onnx_compatible",
    "check_onnx_logits",
    "check_qwen2_pretokenizer",
    "check_qwen3_compatible",
    "copy_tokenizer_files",
    "export_gguf",
    "export_onnx",
    "export_qwen3",
    "fuse_experts",
    "gguf_tensors",
    "load_minimind",
    "onnx_input_names",
    "onnx_output_names",
    "qwen3_config",
    "to_qwen3_model",
]
