"""Products through fbgemm's packed weights, for the compiled steps of several rows and the prompts before them
(`CompiledStep.prompt_model`) on a CPU whose other kernels fall short there: int8 weights by 7-bit activations
(`minimind.decode.int8.Int8RowsProduct`) and 16-bit weights as float16 by float32 rows (`Float16RowsProduct`,
`float16_rows_products`).

A step reaches fbgemm through one op of ours, `minimind::fbgemm_product(rows, weight)`, `weight` an integer naming
the packed copy (`packed_weight`): dynamo cannot put fbgemm's packed-weight object into a graph. The integer is taken
from the weight's values, so that an AOTInductor package of a step, built in one process, finds the same weights
under the same names in another."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable

import torch

from minimind.hardware import torch_kernels_avx512

# fbgemm's packed copies, by the integer the op is called with; a module holding a copy keeps it alive
_PACKED: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
torch.library.define("minimind::fbgemm_product", "(Tensor rows, int weight) -> Tensor")


@torch.library.impl("minimind::fbgemm_product", "cpu")
def _fbgemm_product(rows, weight):
    """rows [M, in] float32 -> [M, out] float32."""
    return _PACKED[weight].multiply(rows)


@torch.library.register_fake("minimind::fbgemm_product")
def _fbgemm_product_shape(rows, weight):
    return rows.new_empty(rows.shape[0], _PACKED[weight].out_features)


def fbgemm_products() -> bool:
    """Whether this torch has fbgemm's products over packed weights (x86 builds). Torch has deprecated its quantized
    tensors, which fbgemm's int8 packing takes: where a later torch drops them, the steps keep their other products."""
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch, "_make_per_channel_quantized_tensor")
        and all(
            hasattr(torch.ops.quantized, op)
            for op in ("linear_prepack", "linear_dynamic", "linear_prepack_fp16", "linear_dynamic_fp16")
        )
    )


class PackedWeight:
    """A weight packed for fbgemm (`packed`), its number of output features, the product that multiplies rows by it
    (`multiply(packed, rows)`), and `key`, the integer `minimind::fbgemm_product` is called with."""

    def __init__(self, key: int, packed, out_features: int, multiply: Callable):
        self.key, self.packed, self.out_features, self._multiply = key, packed, out_features, multiply

    def multiply(self, rows):
        return self._multiply(self.packed, rows)


def packed_weight(kind: str, values: list[torch.Tensor], pack: Callable, multiply: Callable) -> PackedWeight:
    """The packed copy of the weight held in `values` (a product `kind` reads it by), made by `pack()` unless a
    copy of the same values is packed already. Its key is a hash of `kind` and the values' bytes."""
    digest = hashlib.blake2b(kind.encode(), digest_size=8)
    for tensor in values:
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
    key = int.from_bytes(digest.digest()) >> 1  # an int64 of the op's schema
    found = _PACKED.get(key)
    if found is None:
        packed = pack()
        found = PackedWeight(key, packed, values[0].shape[0], multiply)
        _PACKED[key] = found
    return found


def _float16_product(packed, rows):
    return torch.ops.quantized.linear_dynamic_fp16(rows, packed)


class PackedProduct(torch.nn.Module):
    """A linear layer whose weight fbgemm holds packed (`packed`, found again by `key`); a subclass multiplies its
    rows through `torch.ops.minimind.fbgemm_product(rows, self.key)` and adds `bias`, rounding to `out_dtype`."""

    def __init__(self, packed: PackedWeight, bias, out_dtype: torch.dtype):
        super().__init__()
        self._packed = packed
        self.key = packed.key
        self.bias = bias
        self.out_dtype = out_dtype


def multiplies_through_fbgemm(model) -> bool:
    """Whether `model` multiplies any of its linear layers through fbgemm's packed weights (`PackedProduct`)."""
    return any(isinstance(module, PackedProduct) for module in model.modules())


class Float16RowsProduct(PackedProduct):
    """A linear layer over a 16-bit weight [out, in] for steps of several rows where torch's kernels stop at AVX2:
    fbgemm keeps the weight as float16 and multiplies float32 rows by it, widening each block of the weight in
    registers once for every row it multiplies (F16C), as llama.cpp's f16 product does. bfloat16 values within
    float16's normal range are exactly float16 values (`float16_rows_products` leaves a weight with values beyond
    its range to its own product); fbgemm keeps a packed copy of them."""

    def __init__(self, weight, bias=None):
        packed = packed_weight(
            "float16",
            [weight],
            lambda: torch.ops.quantized.linear_prepack_fp16(weight.float(), None),
            _float16_product,
        )
        super().__init__(packed, bias, weight.dtype)

    def forward(self, x):  # [..., in]
        rows = x.reshape(-1, x.shape[-1]).float()  # [M, in]
        out = torch.ops.minimind.fbgemm_product(rows, self.key)  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.out_dtype).reshape(*x.shape[:-1], -1)


def float16_rows_products(model):
    """`model` with each linear layer over a 16-bit weight multiplied through fbgemm (`Float16RowsProduct`): what the
    compiled steps of several rows run where torch's kernels stop at AVX2, on which inductor's own products over
    16-bit weights widen each weight block again for every row. A copy of the modules only: the other tensors are the
    model's own; a layer with a weight beyond float16's range keeps its product. None elsewhere: fp32 or int8 weights,
    another device, torch's kernels on AVX-512, or no fbgemm."""
    from minimind.decode.int8 import modules_copied, plain_weights

    weights = next(model.parameters())
    if (
        weights.dtype not in (torch.bfloat16, torch.float16)
        or weights.device.type != "cpu"
        or not plain_weights(model)
        or torch_kernels_avx512()
        or not fbgemm_products()
    ):
        return None
    view = modules_copied(model)
    for name, module in model.named_modules():
        # fbgemm would clamp a value beyond float16's range without a word: such a layer keeps its own product
        if isinstance(module, torch.nn.Linear) and module.weight.abs().max() <= torch.finfo(torch.float16).max:
            parent, _, child = name.rpartition(".")
            setattr(view.get_submodule(parent), child, Float16RowsProduct(module.weight, module.bias))
    return view
