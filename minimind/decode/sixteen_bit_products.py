"""How a compiled one-row step multiplies by a frozen 16-bit weight on a CPU whose own products for it are slower:
as sums over the weight's rows, in blocks that inductor runs side by side (`SixteenBitProducts`)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from minimind.decode import graph_edits
from minimind.decode.graph_edits import frozen_constant, one_row

# Each product's outputs are split into this many blocks of weight rows, one sum per block. Inductor runs sums of
# one shape over the same input in one loop, so each thread reads this many rows of the weight at once, each into
# an accumulator of its own: one row at a time, a thread waits on its one stream of loads.
ROW_BLOCKS = 8
_CONVERT = torch.ops.prims.convert_element_type.default


class SixteenBitProducts(CustomGraphPass):
    """An inductor pass for one-row steps over 16-bit weights (which steps take it: `CompiledStep.inductor_settings`):
    each product of the row by a frozen weight [out, in] becomes `sum(row * weight, -1)`, both widened to fp32 as
    they are read, with the weight cut into `ROW_BLOCKS` blocks of rows, each a constant of its own, one sum per
    block. Inductor turns each sum into a loop over contiguous runs of the weight, read in its stored 16 bits and
    widened in registers, and runs the blocks' loops together: a one-row product reads each weight once, so it is
    bound by how fast the weights arrive. Inductor's C++ GEMM template (what bfloat16 gets on a CPU without its
    arithmetic) and oneDNN's float16 product decoded markedly slower at one row (docs/performance.md, "The precision
    for the CPU"). The row is computed into memory first (`one_row`), so that what produces it (a norm, an
    activation) runs once and not inside the loop over every weight row."""

    def __call__(self, graph):
        module = graph.owning_module
        for node in list(graph.nodes):
            found = _one_row_product(module, node)
            if found is None:
                continue
            inputs, weight, stored = found
            value = node.meta["val"]  # [..., out]: the product's own leading dimensions
            with graph.inserting_before(node):
                sums = _blocked_sums(graph, inputs, weight, stored)  # [1, out] in fp32
                product = _node(graph, _CONVERT, (sums, value.dtype), sums.meta["val"].to(value.dtype))
                if product.meta["val"].shape != value.shape:
                    shape = list(value.shape)
                    product = _node(
                        graph, torch.ops.aten.view.default, (product, shape), product.meta["val"].view(shape)
                    )
            node.replace_all_uses_with(product)
            graph.erase_node(node)
        graph.eliminate_dead_code()  # the frozen weights the blocks were cut from go with their last user

    def uuid(self):
        return get_hash_for_files((__file__, graph_edits.__file__))


def _one_row_product(module, node):
    """(input, weight node, weight [out, in]) where `node` multiplies one row by a frozen 16-bit weight with nothing
    fused into the product; None elsewhere. The weight reaches the product as the constant [in, out] freezing made
    of its transpose, as that transpose of a constant [out, in], or packed for oneDNN (as float16 can be)."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.aten.mm.default:
        inputs, weight = node.args
        if weight.op == "get_attr":
            stored = getattr(module, weight.target).t()
        elif weight.target is torch.ops.aten.permute.default and weight.args[0].op == "get_attr":
            weight = weight.args[0]
            stored = getattr(module, weight.target)
        else:
            return None
    elif node.target is torch.ops.mkldnn._linear_pointwise.default and tuple(node.args[2:]) == (
        None,
        "none",
        [],
        "",
    ):
        inputs, weight = node.args[:2]
        if weight.op != "get_attr":
            return None
        stored = getattr(module, weight.target)
        stored = stored.to_dense() if stored.is_mkldnn else stored
    else:
        return None
    value = inputs.meta["val"]
    one = value.numel() == value.shape[-1]
    if not one or stored.dim() != 2 or stored.dtype not in (torch.bfloat16, torch.float16):
        return None
    return inputs, weight, stored


def _blocked_sums(graph, inputs, weight, stored):
    """sum(row * weight, -1) in fp32 as `ROW_BLOCKS` sums over blocks of the weight's rows, concatenated: [1, out]."""
    outputs = stored.shape[0]
    blocks = ROW_BLOCKS
    while outputs % blocks:
        blocks //= 2
    size = outputs // blocks
    row = one_row(graph, inputs)  # [1, in]
    wide_row = _node(graph, _CONVERT, (row, torch.float32), row.meta["val"].float())
    sums = []
    for block in range(blocks):
        # [rows, in] in memory of its own (a package writes each constant with its whole storage)
        rows = frozen_constant(
            graph,
            inputs,
            weight,
            f"rows_{block}_of_{blocks}",
            lambda b=block: stored[b * size : (b + 1) * size].clone(memory_format=torch.contiguous_format),
        )  # [size, in]
        wide = _node(graph, _CONVERT, (rows, torch.float32), rows.meta["val"].float())
        products = _node(graph, torch.ops.aten.mul.Tensor, (wide_row, wide), wide_row.meta["val"] * wide.meta["val"])
        sums.append(_node(graph, torch.ops.aten.sum.dim_IntList, (products, [-1]), products.meta["val"].sum(-1)))
    flat = sums[0]
    if blocks > 1:
        flat = _node(graph, torch.ops.aten.cat.default, (sums, 0), torch.cat([part.meta["val"] for part in sums]))
    return _node(graph, torch.ops.aten.view.default, (flat, [1, outputs]), flat.meta["val"].view(1, outputs))


def _node(graph, target, args, value):
    node = graph.call_function(target, args)
    node.meta["val"] = value
    return node
