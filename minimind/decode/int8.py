"""int8 weights for the decoder layers and the LM head (torchao): the 8-bit decode path of the chat and web
commands (`quantize_weights_int8`), and the same weights seen with int8 activations for steps of several rows
(`int8_activation_products`)."""

from __future__ import annotations

import copy
import warnings

import torch

from minimind.hardware import cpu_computes_natively


def quantize_weights_int8(model):
    """Weight-only int8 for every projection of the decoder layers and for the LM head, in place: torchao's
    `Int8WeightOnlyConfig` (one scale per output row), the 8-bit decode path. Each decode step then reads half the
    bytes of bf16. The embedding stays 16-bit (a decode step reads one of its rows); a head tied to it gets an int8
    copy of its own, as llama.cpp's q8_0 files quantize the output matrix too. The model must hold 16-bit weights
    (the activations' dtype), and is for inference from here on: the checkpoint on disk keeps the original
    weights. The compiled decoders multiply steps of several rows with int8 activations over these same weights
    (`int8_activation_products`)."""
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


def plain_weights(model) -> bool:
    """Whether every parameter of `model` is a plain tensor: torchao's int8 weights are tensor subclasses."""
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())


def int8_activation_products(model):
    """`model` with every int8 weight of `quantize_weights_int8` multiplied by int8 activations: each call quantizes
    its input to int8 with one scale per row (per token, symmetric) and multiplies in integer arithmetic, as
    llama.cpp's q8_0 does. A copy of the modules only: the int8 values, their scales and every other tensor are the
    model's own. What the compiled decoders run over several rows (`CompiledStep.model_for`): a weight-only product
    converts every weight to 16 bits before multiplying, which over several rows outweighs reading half the bytes,
    where VNNI multiplies the 8-bit values directly. One row keeps the weight-only product, which is faster there and
    leaves the activations unrounded. Each row's activations have a scale of their own, so a row's result does not
    depend on the rows beside it.
    None where the model holds no such weights, or the CPU has no 8-bit dot products (`minimind.hardware`: without
    them full-range int8 products can overflow)."""
    if plain_weights(model):
        return None  # nothing to import torchao for
    from torchao.quantization import Int8Tensor, PerRow

    try:  # not among torchao's public names: where a later torchao moves it, the rows keep the weight-only product
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs
    except ImportError:
        return None
    weight_only = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and isinstance(module.weight, Int8Tensor)
        and module.weight.act_quant_kwargs is None
    ]
    if not weight_only or not cpu_computes_natively(torch.int8):
        return None
    view = _modules_copied(model)
    activations = QuantizeTensorToInt8Kwargs(granularity=PerRow())
    for name in weight_only:
        linear, weight = view.get_submodule(name), model.get_submodule(name).weight
        products = Int8Tensor(
            weight.qdata,
            weight.scale,
            weight.block_size,
            weight.dtype,
            weight.zero_point,
            act_quant_kwargs=activations,
        )
        linear.weight = torch.nn.Parameter(products, requires_grad=False)
    return view


def _modules_copied(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` and its submodules whose parameters, buffers and other attributes (the config among them)
    are the original's own objects."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {
        name: None if child is None else _modules_copied(child) for name, child in module._modules.items()
    }
    return clone
