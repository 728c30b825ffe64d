"""fp32 products of several rows through oneDNN over the model's own weights, on CPUs whose maker MKL's fast code
paths are not written for (`onednn_products`): what the compiled decoders' prompts run there."""

from __future__ import annotations

import torch
from transformers import activations

from minimind.decode.fp32_products import INTEL_CPU
from modeling_minimind import MiniMindMLP

_product = torch.ops.mkldnn._linear_pointwise
# what `ACT2FN["silu"]` is: transformers' own module in 5.x, torch's in earlier versions
_SILU = (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU))


class OneDnnLinear(torch.nn.Linear):
    """An fp32 `nn.Linear` multiplied by oneDNN (`torch.ops.mkldnn._linear_pointwise`) over its own weight, laid out
    as it is, where ATen's product calls MKL. Its parameters and state-dict names are the plain Linear's; with
    gradients on it is the plain Linear (oneDNN's op has no backward)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.is_grad_enabled() and (input.requires_grad or self.weight.requires_grad):
            return super().forward(input)
        return _product(input, self.weight, self.bias, "none", [], "")


class OneDnnSwiGLU(MiniMindMLP):
    """A SwiGLU MLP whose element-wise work oneDNN does inside its products, over the MLP's own weights: SiLU as the
    gate product's post-op, the multiply by the gate as the up product's, so that neither [..., intermediate]
    activation is read and written once more by an op of its own. Its parameters and state-dict names are the plain
    MLP's; with gradients on it is the plain MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        if torch.is_grad_enabled() and (x.requires_grad or self.gate_proj.weight.requires_grad):
            return super().forward(x)
        gate = _product(x, self.gate_proj.weight, None, "swish", [], "")  # silu(gate(x)) [..., I]
        hidden = _product.binary(x, gate, self.up_proj.weight, None, "mul")  # up(x) * silu(gate(x)) [..., I]
        return self.down_proj(hidden)


def onednn_products(model, intel: bool = INTEL_CPU):
    """`model` with every plain fp32 `nn.Linear` multiplied by oneDNN (`OneDnnLinear`) and every SwiGLU MLP with its
    SiLU and multiply inside oneDNN's products (`OneDnnSwiGLU`), where the CPU's maker is not
    Intel: MKL's fast code paths are Intel's own, and on an AMD EPYC (Zen 4) oneDNN multiplied a prompt's rows by
    the same unpacked weights faster than MKL, the whole forward of 18 tokens and of 512 alike, with the ISA held to
    AVX2 too (docs/performance.md, "The precision for the CPU"). A copy of the modules only: every tensor is the
    model's own, so it adds no memory. None elsewhere: an Intel CPU, weights of another dtype or device or held by a
    tensor subclass, or a torch without oneDNN."""
    from minimind.decode.int8 import modules_copied, plain_weights

    weights = next(model.parameters())
    if (
        intel
        or weights.dtype != torch.float32
        or weights.device.type != "cpu"
        or not plain_weights(model)
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    view = modules_copied(model)
    for module in view.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            module.__class__ = OneDnnLinear
        elif type(module) is MiniMindMLP and type(module.act_fn) in _SILU:
            module.__class__ = OneDnnSwiGLU
    return view
