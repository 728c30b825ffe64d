"""How a compiled step multiplies by a frozen 16-bit weight on a CPU whose own products for it are slower: as sums
over the weight's rows, in blocks that inductor runs side by side (`SixteenBitProducts`)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from minimind.decode import graph_edits
from minimind.decode.graph_edits import CONVERT, ROW_BLOCKS, blocked_sums, call, embedding_holding

__all__ = ["ROW_BLOCKS", "SixteenBitProducts"]


class SixteenBitProducts(CustomGraphPass):
    """An inductor pass for steps over 16-bit weights (which steps take it: `CompiledStep.inductor_settings`): each
    product of the step's rows by a frozen weight [out, in] becomes sums of `rows * weight` over `in` (`blocked_sums`),
    both widened to fp32 as they are read, with the weight cut into `ROW_BLOCKS` blocks of rows, each a constant of
    its own, one sum per block. Inductor turns each sum into a loop over contiguous runs of the weight, read in its
    stored 16 bits and widened in registers, and runs the blocks' loops together: a step reads each weight once, so
    it is bound by how fast the weights arrive. Inductor's C++ GEMM template (what bfloat16 gets on a CPU without its
    arithmetic) and oneDNN's float16 product decoded markedly slower at one row, and on a CPU whose kernels stop at
    AVX2 at several rows too (docs/performance.md, "The precision for the CPU"). The rows are computed into memory
    first (`rows_in_memory`), so that what produces them (a norm, an activation) runs once and not inside the loop
    over every weight row. `tied_head_only`: the pass takes only a tied LM head's product, over the embedding's own
    rows, and leaves the others to the kernel the step's settings give them."""

    def __init__(self, tied_head_only: bool = False):
        super().__init__()
        self.tied_head_only = tied_head_only

    def __call__(self, graph):
        module = graph.owning_module
        for node in list(graph.nodes):
            found = _frozen_16_bit_product(module, node)
            if found is None:
                continue
            inputs, weight, stored = found
            if self.tied_head_only and embedding_holding(graph, stored) is None:
                continue
            value = node.meta["val"]  # [..., out]: the product's own leading dimensions
            with graph.inserting_before(node):
                product = call(graph, CONVERT, (blocked_sums(graph, inputs, weight, stored), value.dtype))
                if product.meta["val"].shape != value.shape:
                    product = call(graph, torch.ops.aten.reshape.default, (product, [*map(int, value.shape)]))
            node.replace_all_uses_with(product)
            graph.erase_node(node)
        graph.eliminate_dead_code()  # the frozen weights the blocks were cut from go with their last user

    def uuid(self):
        return get_hash_for_files((__file__, graph_edits.__file__)) + (b"tied head" if self.tied_head_only else b"")


def _frozen_16_bit_product(module, node):
    """(input, weight node, weight [out, in]) where `node` multiplies its input rows by a frozen 16-bit weight with
    nothing fused into the product; None elsewhere. The weight reaches the product as the constant [in, out]
    freezing made of its transpose, as that transpose of a constant [out, in], or packed for oneDNN (as float16 can
    be)."""
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
    if stored.dim() != 2 or stored.dtype not in (torch.bfloat16, torch.float16):
        return None
    return inputs, weight, stored
