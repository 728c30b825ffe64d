"""int8 weights for the decoder layers and the LM head (torchao): the 8-bit decode path of the chat and web
commands (`quantize_weights_int8`), and the same weights seen with int8 activations for steps of several rows
(`int8_activation_products`)."""

from __future__ import annotations

import copy
import sys
import warnings

import torch

from minimind.decode.fbgemm import PackedProduct, fbgemm_products, packed_weight
from minimind.hardware import cpu_computes_natively


def quantize_weights_int8(model):
    """Weight-only int8 for every projection of the decoder layers and for the LM head, in place: torchao's
    `Int8WeightOnlyConfig` (one scale per output row), the 8-bit decode path. Each decode step then reads half the
    bytes of bf16. The embedding keeps the model's dtype (a decode step reads one of its rows); a head tied to it
    gets an int8 copy of its own, as llama.cpp's q8_0 files quantize the output matrix too. The model's dtype is the
    activations' (`int8_activations_dtype` picks it for the CPU), and it is for inference from here on: the
    checkpoint on disk keeps the original weights. The compiled decoders multiply steps of several rows with int8
    activations over these same weights (`int8_activation_products`)."""
    dtype = next(model.parameters()).dtype
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"int8 weights pair with bfloat16, float16 or float32 activations, but the model holds {dtype}: load "
            f"it with dtype=torch.{int8_activations_dtype()} first"
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


ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def int8_activations_dtype(device: str = "cpu") -> str:
    """The activations' dtype for int8 weights on `device`: float32 on a CPU without bfloat16 arithmetic, whose
    one-row steps then multiply as `Int8RowSums` (with bfloat16 activations there every value would be widened
    twice); bfloat16 elsewhere, as every 16-bit path."""
    on_cpu = torch.device(device).type == "cpu"
    return "float32" if on_cpu and cpu_computes_natively(torch.bfloat16) is False else "bfloat16"


def plain_weights(model) -> bool:
    """Whether every parameter of `model` is a plain tensor: torchao's int8 weights are tensor subclasses."""
    return all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in model.parameters())


class Int8WeightOnlyProduct(torch.nn.Module):
    """One of torchao's weight-only int8 linear layers over plain tensors: `qdata` (int8 [out, in]) and `scale` (one
    per output row), multiplied as torchao's per-row product multiplies them (the activations by the weight widened
    to their dtype, then by the scales), so the logits are torchao's own. Plain tensors can be exported, which
    torchao's tensor subclasses cannot: what lets a one-row int8 step be packaged (`weight_only_int8_view`)."""

    def __init__(self, weight, bias=None):
        super().__init__()
        # persistent: `minimind.decode.packages.weights_digest` reads the state dict
        self.register_buffer("qdata", weight.qdata)
        self.register_buffer("scale", weight.scale)
        self.bias = bias

    def forward(self, x):  # [..., in]
        # The widening as prims' conversion, which is how inductor's freezing recognises a weight-only int8 product:
        # it leaves the int8 weight unfolded and multiplies it as it is. An exported step would otherwise reach
        # freezing with `_to_copy`, which folds into a 16-bit copy of every weight, multiplied as such.
        widened = torch.ops.prims.convert_element_type(self.qdata.permute(1, 0), x.dtype)  # [in, out]
        rows = torch.mm(x.reshape(-1, x.shape[-1]), widened)  # [M, out]
        out = (rows * self.scale.to(rows.dtype).flatten()).reshape(*x.shape[:-1], -1)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


# Int8RowSums reads byte b of a word in place, masked off the others: its value times 256^b, which float32 holds
# exactly, against activations scaled by 256^-b (a power of two, exact too). PyTorch's CPU vectors shift by a count
# per lane, slower than a mask, so no byte is shifted. A mask extends no sign: the three lower bytes are stored with
# 128 added (0..255) and 128 times their activations' sum is taken off after; the top byte's mask keeps the word's
# sign bit, so it is stored as it is.
BYTE_MASKS = (0xFF, 0xFF00, 0xFF0000, -(1 << 24))  # the last is 0xFF000000 as a signed int32
BYTE_OFFSETS = (128, 128, 128, 0)


class Int8RowSums(torch.nn.Module):
    """One of torchao's weight-only int8 linear layers for float32 activations, multiplied as sums that inductor
    compiles into one loop per layer: each int32 word of `words` holds four int8 values of a row, which the loop
    masks out of it in place (`BYTE_MASKS`) and multiplies in float32 (`words` is a copy of the values in that
    order, the three lower bytes plus 128, the size of the int8 values). The one-row step of a CPU without bfloat16
    arithmetic runs these (`weight_only_int8_view`): inductor's product for int8 weights there multiplies one row at
    the rate of a bfloat16 product, and its own loads of int8 values copy each through a buffer. Results are
    torchao's up to float32 rounding (the order of additions, the offsets taken off)."""

    def __init__(self, weight, bias=None):
        super().__init__()
        out_features, in_features = weight.qdata.shape
        quarter = in_features // 4
        # word j of a row holds its values j, j + quarter, j + 2 quarter and j + 3 quarter, lowest byte first, so
        # that each of the four pairs with a contiguous quarter of the activations; `^ 128` adds 128 to an int8
        # value seen as a byte
        values = weight.qdata.view(out_features, 4, quarter).transpose(1, 2).view(torch.uint8)  # [out, in / 4, 4]
        words = (values ^ torch.tensor(BYTE_OFFSETS, dtype=torch.uint8)).contiguous()
        self.register_buffer("words", words.view(torch.int32).view(out_features, quarter))  # [out, in / 4]
        self.register_buffer("scale", weight.scale.reshape(-1).float())  # [out]
        self.bias = bias

    def forward(self, x):  # [..., in]
        quarters = x.reshape(-1, 1, 4, self.words.shape[-1]).float()  # [M, 1, 4, in / 4]
        out = None
        for byte, mask in enumerate(BYTE_MASKS):
            values = (self.words & mask).float()  # [out, in / 4]: (value + offset) * 256^byte
            term = quarters[:, :, byte] * 2.0 ** (-8 * byte) * values  # [M, out, in / 4]
            out = term if out is None else out + term
        offsets = sum(offset * quarters[:, 0, byte].sum(-1) for byte, offset in enumerate(BYTE_OFFSETS) if offset)
        out = (out.sum(-1) - offsets[:, None]) * self.scale  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def weight_only_int8_view(model):
    """`model` with every int8 weight of `quantize_weights_int8` seen over plain tensors: what the compiled one-row
    steps run and export. float32 activations multiply as `Int8RowSums` (on a little-endian machine, every layer's
    input a multiple of 4 wide), others as `Int8WeightOnlyProduct`. A copy of the modules only: the int8 values
    (but `Int8RowSums`' words), their scales and every other tensor are the model's own. None where the model holds
    other tensor subclasses (int8 activations, scales per group of columns, a scale applied to the activations
    first), which the view would not multiply as torchao does."""
    if plain_weights(model):
        return None
    from torchao.quantization import Int8Tensor

    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), Int8Tensor)
    ]
    # the words' byte order is the masks' (the lowest byte first) on a little-endian machine only
    sums = (
        next(model.parameters()).dtype == torch.float32
        and sys.byteorder == "little"
        and all(module.weight.qdata.shape[-1] % 4 == 0 for _, module in layers)
    )
    if any(
        not isinstance(module, torch.nn.Linear)
        or module.weight.act_quant_kwargs is not None
        or getattr(module.weight, "act_pre_scale", None) is not None
        or tuple(module.weight.block_size) != (1, module.weight.qdata.shape[-1])
        for _, module in layers
    ):
        return None  # before any layer is built: `Int8RowSums` copies its values
    product = Int8RowSums if sums else Int8WeightOnlyProduct
    view = modules_copied(model)
    for name, module in layers:
        parent, _, child = name.rpartition(".")
        setattr(view.get_submodule(parent), child, product(module.weight, module.bias))
    return view if plain_weights(view) else None


def int8_activation_products(model):
    """`model` with every int8 weight of `quantize_weights_int8` multiplied by int8 activations: each call quantizes
    its input to int8 with one scale per row (per token, symmetric) and multiplies in integer arithmetic, as
    llama.cpp's q8_0 does. A copy of the modules only: the int8 values, their scales and every other tensor are the
    model's own. What the compiled decoders run over several rows (`CompiledStep.model_for`; their prompts too where
    fbgemm multiplies, `CompiledStep.prompt_model`): a weight-only product converts every weight to 16 bits before
    multiplying, which over several rows outweighs reading half the bytes.
    One row keeps the weight-only product, which is faster there and leaves the activations unrounded. Each row's
    activations have a scale of their own, so a row's result does not depend on the rows beside it.
    With 8-bit dot products (VNNI, `minimind.hardware`) torchao's product multiplies the full 8 bits; without them
    full-range 8-bit products can overflow the 16-bit sums the CPU adds them in, so fbgemm multiplies 7-bit
    activations instead (`Int8RowsProduct`, which keeps a packed copy of the int8 values).
    None where the model holds no such weights, or neither way is available (CPU features unknown, or a torch
    without fbgemm on a CPU without 8-bit dot products)."""
    if plain_weights(model):
        return None  # nothing to import torchao for
    from torchao.quantization import Int8Tensor, PerRow

    weight_only = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and isinstance(module.weight, Int8Tensor)
        and module.weight.act_quant_kwargs is None
    ]
    native = cpu_computes_natively(torch.int8)
    if not weight_only or native is None or (not native and not fbgemm_products()):
        return None
    view = modules_copied(model)
    if not native:
        for name in weight_only:
            linear = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            setattr(view.get_submodule(parent), child, Int8RowsProduct(linear.weight, linear.bias))
        return view
    try:  # not among torchao's public names: where a later torchao moves it, the rows keep the weight-only product
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs
    except ImportError:
        return None
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


ROW_END = 126.0  # what each row's largest magnitude is scaled to for `Int8RowsProduct`


def _7_bit_product(packed, rows):
    """rows [M, in] float32 -> [M, out] float32, the rows quantized together with one scale and zero point."""
    # reduce_range: 7-bit activations, so that a pair of 8-bit weights times activations adds up within 16 bits,
    # as a CPU without 8-bit dot products adds them (fbgemm's default on x86 for the same reason)
    return torch.ops.quantized.linear_dynamic(rows, packed, True)


class Int8RowsProduct(PackedProduct):
    """A linear layer over one of torchao's int8 weights (one scale per output row) for steps of several rows on a
    CPU without 8-bit dot products: fbgemm multiplies the int8 values by 7-bit activations with one symmetric scale
    per row (values -63..63 times the row's largest magnitude / 63) and adds pairs of products in 16 bits as such a
    CPU does. fbgemm picks one scale and zero point for its whole input from its least and greatest value: each row
    is scaled to [-126, 126] and goes with a row holding -128 and 126, which fixes that grid to steps of 2 around
    zero for every row, so a row's result does not depend on the rows beside it. fbgemm keeps a packed copy of the
    int8 values."""

    def __init__(self, weight, bias=None):
        out_features, in_features = weight.qdata.shape

        def pack():
            with warnings.catch_warnings():  # torch's quantized tensors announce their deprecation
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(
                    weight.qdata, weight.scale.reshape(-1).double(), torch.zeros(out_features, dtype=torch.long), 0
                )
                return torch.ops.quantized.linear_prepack(quantized, None)

        super().__init__(packed_weight("int8", [weight.qdata, weight.scale], pack, _7_bit_product), bias, weight.dtype)
        ends = torch.zeros(1, in_features)
        ends[0, :2] = torch.tensor([ROW_END, -ROW_END - 2])
        self.register_buffer("ends", ends, persistent=False)

    def forward(self, x):  # [..., in]
        rows = x.reshape(-1, x.shape[-1]).float()  # [M, in]
        scale = rows.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / ROW_END  # [M, 1]
        product = torch.ops.minimind.fbgemm_product(torch.cat([rows / scale, self.ends]), self.key)
        out = product[:-1] * scale  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.out_dtype).reshape(*x.shape[:-1], -1)


def modules_copied(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` and its submodules whose parameters, buffers and other attributes (the config among them)
    are the original's own objects."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {
        name: None if child is None else modules_copied(child) for name, child in module._modules.items()
    }
    return clone
