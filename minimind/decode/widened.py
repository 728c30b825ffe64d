"""Half-precision storage with float32 arithmetic for the products of many rows, on a CPU that has no arithmetic of its
own for the weights' 16-bit type (`widen_products`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minimind.hardware import cpu_computes_natively

# Products over this many rows or more are widened. Widening converts the weight on every call, a pass over its
# bytes: it pays off when the rows make the product compute-bound. Below it (decoding, up to a batch of 8 rows) the
# 16-bit product reads half the bytes of a float32 one and is the faster of the two.
WIDEN_MIN_ROWS = 32


class WidenedLinear(torch.nn.Linear):
    """A 16-bit `nn.Linear` that multiplies `WIDEN_MIN_ROWS` rows or more in float32 (weights converted for the call,
    the result rounded back to the input's dtype) and fewer rows in its own dtype. Its parameters, state-dict names
    and one-row outputs are the plain Linear's. Compiled graphs keep the plain product: they are the decode steps."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if input.numel() // self.in_features < WIDEN_MIN_ROWS or torch.compiler.is_compiling():
            return super().forward(input)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(input.float(), self.weight.float(), bias).to(input.dtype)


def widen_products(model) -> int:
    """Every plain 16-bit `nn.Linear` of `model` on the CPU becomes a `WidenedLinear` in place when this CPU has no
    arithmetic of its own for that dtype (bfloat16 without AVX512_BF16 / AMX, float16 without AVX512_FP16 / AMX):
    prompts then run at float32's speed while decoding keeps reading 16-bit weights. Weights held by another tensor
    type (int8 from torchao) are left alone. Returns how many were widened."""
    widened = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is torch.nn.Linear
            and type(weight) is torch.nn.Parameter
            and weight.device.type == "cpu"
            and weight.dtype in (torch.bfloat16, torch.float16)
            and cpu_computes_natively(weight.dtype) is False
        ):
            module.__class__ = WidenedLinear
            widened += 1
    return widened
