"""What the inductor passes over a frozen step's graph (`Fp32Products`, `SixteenBitProducts`) share: a product's
input seen as rows in memory, frozen constants of their own made from a weight, and a product written as sums over
blocks of the weight's rows (`blocked_sums`)."""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)


def rows_in_memory(graph, inputs):
    """`inputs` [..., in] as an [R, in] matrix with the strides (in, 1), R the product of the leading dimensions,
    computed into memory of its own once: inductor would otherwise fuse what produces the rows (a norm, an
    activation) into the loops of the kernel that reads them, once for every weight row. One row is an as_strided
    view: inductor gives a one-row view the strides (0, 1), and ATen's product copies such an input first (in every
    product) because the stride reads as no leading dimension; an as_strided view needs its input in memory.
    as_strided reads the storage under any view as laid out [rows, in], which is right for one row with unit
    stride only: several rows are required in that layout instead (a copy where they are laid out otherwise)."""
    value = inputs.meta["val"]
    width = int(value.shape[-1])  # the step's shapes are static: plain ints in the graph, not symbols
    rows = int(value.numel()) // width
    if rows > 1:
        matrix = call(graph, torch.ops.aten.reshape.default, (inputs, [rows, width]))
        return call(graph, torch.ops.prims.inductor_force_stride_order.default, (matrix, [width, 1]))
    if value.stride(-1) != 1:  # not one run of memory: leave it to ATen
        return call(graph, torch.ops.aten.reshape.default, (inputs, [1, width]))
    return call(graph, torch.ops.aten.as_strided.default, (inputs, [1, width], [width, 1]))


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


# Each product's outputs are split into this many blocks of weight rows, one sum per block. Inductor runs sums of
# one shape over the same input in one loop, so each thread reads this many rows of the weight at once, each into
# an accumulator of its own: one row at a time, a thread waits on its one stream of loads. Each accumulator takes
# two vector registers (16 fp32 lanes under AVX2): eight blocks fill AVX2's sixteen registers with accumulators
# alone, so the loop spills. With AVX-512's thirty-two registers there is no spill, yet four streams of loads per
# thread still decoded faster than eight (docs/performance.md, "The precision for the CPU").
ROW_BLOCKS = 4
CONVERT = torch.ops.prims.convert_element_type.default


def blocked_sums(graph, inputs, weight, stored):
    """The product of `inputs` [..., in] by the frozen weight `stored` [out, in] (the get_attr node `weight`) as
    sums in fp32 over `ROW_BLOCKS` blocks of the weight's rows, each block a contiguous constant of its own, read
    in its stored dtype and widened in registers: [R, out] in fp32, R the rows of `inputs`. One row sums
    `row * block` over `in`; several sum `block[:, None] * rows[None]`, weight rows outermost, so that each weight
    row is read once for all the input rows. A tied LM head's blocks are slices of the embedding's table, which the
    step holds anyway (`embedding_holding`), so that the step holds no copy of it."""
    outputs = stored.shape[0]
    blocks = ROW_BLOCKS
    while outputs % blocks:
        blocks //= 2
    size = outputs // blocks
    rows = rows_in_memory(graph, inputs)  # [R, in]
    count = rows.meta["val"].shape[0]
    wide_rows = _widened(graph, rows)
    if count > 1:
        wide_rows = call(graph, torch.ops.aten.unsqueeze.default, (wide_rows, 0))  # [1, R, in]
    table = embedding_holding(graph, stored)
    sums = []
    for block in range(blocks):
        if table is not None:  # rows of a contiguous table: a contiguous [size, in] view of it
            part = call(graph, torch.ops.aten.slice.Tensor, (table, 0, block * size, (block + 1) * size))
        else:  # [size, in] in memory of its own (a package writes each constant with its whole storage)
            part = frozen_constant(
                graph,
                inputs,
                weight,
                f"rows_{block}_of_{blocks}",
                lambda b=block: stored[b * size : (b + 1) * size].clone(memory_format=torch.contiguous_format),
            )
        wide = _widened(graph, part)
        if count > 1:
            wide = call(graph, torch.ops.aten.unsqueeze.default, (wide, 1))  # [size, 1, in]
        products = call(graph, torch.ops.aten.mul.Tensor, (wide_rows, wide))
        sums.append(call(graph, torch.ops.aten.sum.dim_IntList, (products, [-1])))  # [size] or [size, R]
    flat = sums[0] if blocks == 1 else call(graph, torch.ops.aten.cat.default, (sums, 0))  # [out] or [out, R]
    if count == 1:
        return call(graph, torch.ops.aten.view.default, (flat, [1, outputs]))
    return call(graph, torch.ops.aten.permute.default, (flat, [1, 0]))  # [R, out]


def embedding_holding(graph, weight):
    """The constant an embedding lookup in `graph` reads, where it holds `weight` (a tied LM head's), else None."""
    for node in graph.nodes:
        if node.target is torch.ops.aten.embedding.default and getattr(node.args[0], "op", None) == "get_attr":
            table = graph.owning_module
            for part in node.args[0].target.split("."):
                table = getattr(table, part)
            if table.shape == weight.shape and table.dtype == weight.dtype and torch.equal(table, weight):
                return node.args[0]
    return None


def _widened(graph, node):
    value = node.meta["val"]
    return node if value.dtype == torch.float32 else call(graph, CONVERT, (node, torch.float32))


def call(graph, target, args):
    """A call of `target` in `graph`, its value computed from the values of `args`."""
    node = graph.call_function(target, args)
    node.meta["val"] = target(*_values(args))
    return node


def _values(arg):
    if isinstance(arg, torch.fx.Node):
        return arg.meta["val"]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_values(item) for item in arg)
    return arg
