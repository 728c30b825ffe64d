"""Which kernel a compiled fp32 step multiplies its rows by a frozen weight with, chosen by the number of rows and
the CPU's maker (`fp32_product_kernel`), and the inductor pass that puts that kernel in (`Fp32Products`)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from minimind.decode import graph_edits
from minimind.decode.graph_edits import blocked_sums, call, embedding_holding, frozen_constant, rows_in_memory
from minimind.hardware import cpu_vendor, torch_kernels_avx512

ONEDNN_MIN_ROWS = 4  # fp32 products of this many rows or more go to oneDNN's packed kernel


# MKL's fast code paths are Intel's own: on an AMD EPYC (Zen 4, AVX-512) its fp32 products read the weights more
# slowly than oneDNN's and inductor's C++ template do. Unknown makers keep the Intel table (a CPU without MKL, as on
# ARM, has no MKL-packed products for the table to choose for).
INTEL_CPU = cpu_vendor() in ("GenuineIntel", "")
AVX512_KERNELS = torch_kernels_avx512()


def fp32_product_kernel(rows: int, intel: bool = INTEL_CPU, avx512: bool = AVX512_KERNELS) -> str:
    """The kernel a compiled fp32 step multiplies `rows` rows by a frozen weight with (`Fp32Products`)."""
    if rows == 1 and intel:
        return "plain"
    if not avx512:
        return "onednn" if not intel and rows >= ONEDNN_MIN_ROWS else "sums"
    if rows == 1:
        return "template"
    return "mkl" if intel and rows < ONEDNN_MIN_ROWS else "onednn"


class Fp32Products(CustomGraphPass):
    """An inductor pass for fp32 steps: each prepacked product (MKL's packed GEMM, which freezing puts in for every
    fp32 linear under torch.compile; oneDNN's under AOTInductor) gets the kernel that decoded fastest for its number
    of rows on the 64M model (2 threads, decoders side by side in one process). On an Intel Xeon:
    - one row: MKL's plain product with the weight laid out [in, out] contiguous, ahead of both packed ones; a tied
      LM head multiplies by the embedding's own table, transposed (as fast, and the step holds no copy of it);
    - two or three rows: MKL's packed product stays, ahead of oneDNN's (under AOTInductor, oneDNN's stays);
    - four rows or more: oneDNN's packed product, as 16-bit weights get (level with MKL's packed one at four rows,
      ahead from there on).
    Where torch's kernels stop at AVX2 (no AVX-512), two rows or more multiply as sums over blocks of the weight's
    rows (`graph_edits.blocked_sums`), ahead of MKL's and oneDNN's packed products there.
    On an AMD EPYC (Zen 4), where MKL runs slow:
    - one row: inductor's own C++ GEMM template, which the packed node lowers to when it is the only choice
      (`inductor_settings`), ahead of MKL's plain product and oneDNN's packed one; a tied LM head as sums over
      blocks of the embedding's own rows (`blocked_sums`), as fast, where the template would pack a copy of them.
      Where torch's kernels stop at AVX2, blocked sums for one row too, ahead of the template there;
    - two rows or more: oneDNN's packed product, ahead of MKL's packed one and of autotuning between the template
      and MKL's packed product. Where torch's kernels stop at AVX2, two or three rows multiply as blocked sums and
      four or more (`ONEDNN_MIN_ROWS`) through oneDNN's packed product: level at four rows, ahead at eight.
    Packing cannot simply be switched off per graph: inductor registers its packing patterns once per process, at
    the first frozen compile, and only if `cpp.weight_prepack` is on then; a bf16 or int8 decoder built later
    would lose its packed kernels."""

    def __call__(self, graph):
        module = graph.owning_module
        for node in list(graph.nodes):
            product = self._product(graph, module, node)
            if product is None:
                continue
            product.meta.update(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
        graph.eliminate_dead_code()  # the packed copies go with their last user

    def _product(self, graph, module, node):
        """The product that replaces a packed one (`node`), or None where it stays. Inductor packs fp32 weights for
        MKL under torch.compile and for oneDNN under AOTInductor (MKL's packed product has no AOTInductor kernel);
        either way the weight's plain [out, in] form is recovered to lay it out for the chosen kernel."""
        if node.op != "call_function":
            return None
        if node.target in (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default):
            inputs, _packed, weight, bias, _batch = node.args  # inputs [N, in], weight [out, in], a frozen constant
            onednn = False
        elif node.target is torch.ops.mkldnn._linear_pointwise.default and _plain_onednn_product(module, node):
            inputs, weight, bias = node.args[:3]  # weight: the oneDNN-packed constant
            onednn = True
        else:
            return None
        value = inputs.meta["val"]  # [..., in]: oneDNN's product takes any leading dimensions
        rows = value.numel() // value.shape[-1]
        kernel = fp32_product_kernel(rows)
        if kernel == "mkl" or (onednn and kernel == "onednn"):
            # under AOTInductor oneDNN's packed product stays where MKL's packed one would be chosen
            return None
        stored = getattr(module, weight.target)
        stored = stored.to_dense() if onednn else stored  # [out, in]
        if kernel == "template":
            if embedding_holding(graph, stored) is None:
                return None  # the template takes the packed product over when lowering it
            kernel = "sums"  # a tied head, over the embedding's own rows: the template would pack a copy of them
        with graph.inserting_before(node):
            if kernel == "sums":
                product = blocked_sums(graph, inputs, weight, stored)  # [R, out]
                if bias is not None:
                    product = call(graph, torch.ops.aten.add.Tensor, (product, bias))
                shape = [*map(int, value.shape[:-1]), stored.shape[0]]  # [..., out]
                return call(graph, torch.ops.aten.reshape.default, (product, shape))
            if kernel == "plain":
                embedding = embedding_holding(graph, stored)
                if embedding is not None:
                    weight_in_out = graph.call_function(torch.ops.aten.permute.default, (embedding, [1, 0]))
                    weight_in_out.meta["val"] = embedding.meta["val"].permute(1, 0)
                else:  # [in, out]
                    weight_in_out = frozen_constant(graph, inputs, weight, "in_out", lambda: stored.t().contiguous())
                row = rows_in_memory(graph, inputs)  # [1, in]
                product = (
                    graph.call_function(torch.ops.aten.mm.default, (row, weight_in_out))
                    if bias is None
                    else graph.call_function(torch.ops.aten.addmm.default, (bias, row, weight_in_out))
                )  # [1, out]
                product.meta["val"] = row.meta["val"] @ weight_in_out.meta["val"]
                if value.dim() == 2:
                    return product
                shape = [*value.shape[:-1], stored.shape[0]]  # [..., out]
                return graph.call_function(torch.ops.aten.view.default, (product, shape))
            # an opaque oneDNN tensor, which inductor lowers by the shape of the weight it packs (MKL's plain one)
            packed = frozen_constant(
                graph,
                inputs,
                weight,
                f"onednn_{rows}",
                lambda: torch.ops.mkldnn._reorder_linear_weight(stored, rows),
                lowered_as=stored,
            )
            return graph.call_function(
                torch.ops.mkldnn._linear_pointwise.default, (inputs, packed, bias, "none", [], "")
            )

    def uuid(self):
        return get_hash_for_files((__file__, graph_edits.__file__))


def _plain_onednn_product(module, node) -> bool:
    """A oneDNN product of an fp32 weight packed as a frozen constant, with nothing fused into it."""
    weight = node.args[1]
    if getattr(weight, "op", None) != "get_attr" or tuple(node.args[3:]) != ("none", [], ""):
        return False
    value = getattr(module, weight.target, None)
    return isinstance(value, torch.Tensor) and value.is_mkldnn and value.dtype == torch.float32
