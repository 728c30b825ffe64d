"""Weight-only int8 for the decoder layers (torchao): the 8-bit decode path of the chat and web commands."""

from __future__ import annotations

import warnings

import torch


def quantize_weights_int8(model):
    """Weight-only int8 for every projection of the decoder layers and for the LM head, in place: torchao's
    `Int8WeightOnlyConfig` (one scale per output row), the 8-bit decode path. Each decode step then reads half the
    bytes of bf16. The embedding stays 16-bit (a decode step reads one of its rows); a head tied to it gets an int8
    copy of its own, as llama.cpp's q8_0 files quantize the output matrix too. The model must hold 16-bit weights
    (the activations' dtype), and is for inference from here on: the checkpoint on disk keeps the original
    weights."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"int8 weights pair with 16-bit activations, but the model holds {dtype}: load it with "
            "dtype=torch.bfloat16 first"
        )
    with warnings.catch_warnings():  # torchao's CUDA-only kernels announce their absence on a CPU machine
        warnings.simplefilter("ignore")
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as error:
            raise ImportError(
                f"int8 weights use torchao, which is not installed ({error}): pip install 'minimind[int8]'"
            ) from error
        quantize_(model, Int8WeightOnlyConfig())  # every nn.Linear: the layers' projections and the LM head
    return model
