"""Which kernel a compiled fp32 step multiplies its rows by a frozen weight with, chosen by the number of rows and
the CPU's maker (`fp32_product_kernel`), and the inductor pass that puts that kernel in (`Fp32Products`)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from minimind.hardware import cpu_vendor

ONEDNN_MIN_ROWS = 4  # fp32 products of this many rows or more go to oneDNN's packed kernel


# MKL's fast code paths are Intel's own: on an AMD EPYC (Zen 4, AVX-512) its fp32 products read the weights more
# slowly than oneDNN's and inductor's C++ template do. Unknown makers keep the Intel table (a CPU without MKL, as on
# ARM, has no MKL-packed products for the table to choose for).
INTEL_CPU = cpu_vendor() in ("GenuineIntel", "")


def fp32_product_kernel(rows: int, intel: bool = INTEL_CPU) -> str:
    """The kernel a compiled fp32 step multiplies `rows` rows by a frozen weight with (`Fp32Products`)."""
    if rows == 1:
        return "plain" if intel else "template"
    return "mkl" if intel and rows < ONEDNN_MIN_ROWS else "onednn"


class Fp32Products(CustomGraphPass):
    """An inductor pass for fp32 steps: each prepacked product (MKL's packed GEMM, which freezing puts in for every
    fp32 linear) gets the kernel that decoded fastest for its number of rows on the 64M model (2 threads, decoders
    side by side in one process). On an Intel Xeon:
    - one row: MKL's plain product with the weight laid out [in, out] contiguous, ahead of the packed one;
    - two or three rows: MKL's packed product stays, ahead of oneDNN's;
    - four rows or more: oneDNN's packed product, as 16-bit weights get (level with MKL's packed one at four rows,
      ahead from there on).
    On an AMD EPYC (Zen 4), where MKL runs slow:
    - one row: inductor's own C++ GEMM template, which the packed node lowers to when it is the only choice
      (`inductor_settings`), ahead of MKL's plain product and oneDNN's packed one;
    - two rows or more: oneDNN's packed product, ahead of MKL's packed one and of autotuning between the template
      and MKL's packed product.
    Packing cannot simply be switched off per graph: inductor registers its packing patterns once per process, at
    the first frozen compile, and only if `cpp.weight_prepack` is on then; a bf16 or int8 decoder built later
    would lose its packed kernels."""

    def __call__(self, graph):
        module = graph.owning_module
        packed_linear = (torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default)
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in packed_linear:
                continue
            inputs, _packed, weight, bias, _batch = node.args  # inputs [N, in], weight [out, in], a frozen constant
            rows = inputs.meta["val"].shape[0]
            kernel = fp32_product_kernel(rows)
            if kernel in ("mkl", "template"):
                continue
            with graph.inserting_before(node):
                if kernel == "plain":
                    # Inductor gives a one-row view the strides (0, 1); ATen's product copies such an input first
                    # (in every product) because the stride reads as no leading dimension. (in, 1) is the same row.
                    row = self._with_leading_stride(graph, inputs)
                    weight_in_out = self._constant(
                        graph,
                        module,
                        weight,
                        "in_out",
                        lambda w: w.t().contiguous(),
                        weight.meta["val"].t().contiguous(),
                    )  # [in, out]
                    product = (
                        graph.call_function(torch.ops.aten.mm.default, (row, weight_in_out))
                        if bias is None
                        else graph.call_function(torch.ops.aten.addmm.default, (bias, row, weight_in_out))
                    )
                else:
                    # an opaque oneDNN tensor, which inductor lowers by the shape of the weight it packs
                    packed = self._constant(
                        graph,
                        module,
                        weight,
                        f"onednn_{rows}",
                        lambda w, rows=rows: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                        weight.meta["val"],
                    )
                    product = graph.call_function(
                        torch.ops.mkldnn._linear_pointwise.default, (inputs, packed, bias, "none", [], "")
                    )
            product.meta.update(node.meta)
            node.replace_all_uses_with(product)
            graph.erase_node(node)
        graph.eliminate_dead_code()  # the MKL-packed copies go with their last user

    @staticmethod
    def _with_leading_stride(graph, row):
        value = row.meta["val"]
        if value.stride(-1) != 1:  # not one run of memory: leave it to ATen
            return row
        strided = graph.call_function(
            torch.ops.aten.as_strided.default, (row, list(value.shape), [value.shape[-1], 1])
        )
        strided.meta["val"] = value.as_strided(value.shape, (value.shape[-1], 1))
        return strided

    @staticmethod
    def _constant(graph, module, weight, suffix, relaid, meta_value):
        """A frozen constant holding `relaid(weight)`, lowered by inductor as `meta_value` describes it."""
        name = f"{weight.target}_{suffix}"
        if not hasattr(module, name):
            module.register_buffer(name, relaid(getattr(module, weight.target)))
        node = graph.get_attr(name)
        node.meta["val"] = meta_value
        return node

    def uuid(self):
        return get_hash_for_files((__file__,))
