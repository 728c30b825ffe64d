"""What the inductor passes over a frozen step's graph (`Fp32Products`, `SixteenBitProducts`) share: a product's
input seen as one row, and frozen constants of their own made from a weight."""

from __future__ import annotations

import torch


def one_row(graph, inputs):
    """`inputs` (one row, any leading dimensions of size 1) as a [1, in] matrix with the strides (in, 1): inductor
    gives a one-row view the strides (0, 1), and ATen's product copies such an input first (in every product)
    because the stride reads as no leading dimension. The row is also computed into memory of its own once, where
    inductor would otherwise fuse what produces it (a norm, an activation) into the loops of the kernel that reads
    it: an as_strided view needs its input in memory."""
    value = inputs.meta["val"]
    width = value.shape[-1]
    if value.stride(-1) != 1:  # not one run of memory: leave it to ATen
        row = graph.call_function(torch.ops.aten.reshape.default, (inputs, [1, width]))
        row.meta["val"] = value.reshape(1, width)
        return row
    row = graph.call_function(torch.ops.aten.as_strided.default, (inputs, [1, width], [width, 1]))
    row.meta["val"] = value.as_strided((1, width), (width, 1))
    return row


def frozen_constant(graph, inputs, weight, suffix, make, lowered_as=None):
    """A frozen constant holding `make()` (made once per weight and suffix), named after `weight`'s (a get_attr
    node), lowered by inductor as `lowered_as` (default: the constant itself) describes it."""
    module, name = graph.owning_module, f"{weight.target}_{suffix}"
    if not hasattr(module, name):
        module.register_buffer(name, make())
    node = graph.get_attr(name)
    described = getattr(module, name) if lowered_as is None else lowered_as
    node.meta["val"] = inputs.meta["val"].fake_mode.from_tensor(described)
    return node
