"""Fast decoding: the model's one-token step compiled once against a static KV cache.

Every name is importable from here; each lives in the module that does its job:

- `compiled`: the compiled step (`CompiledStep`: inductor's settings, freezing, one code object per decoder, the
  eager fallback) and `CompiledDecoder`, the chat front ends' `generate`; `CACHE_BUCKET`, `cache_length`.
- `attention`: `grouped_query_sdpa`, the steps' attention, registered as `GROUPED_QUERY_SDPA`.
- `fp32_products`: the fp32 product kernel per number of rows, CPU maker and vector width (`fp32_product_kernel`)
  and the inductor pass that puts it in (`Fp32Products`).
- `sixteen_bit_products`: products over 16-bit weights on a CPU (one row of bfloat16 without its arithmetic and of
  float16 everywhere, several rows too where torch's kernels stop at AVX2), as sums over blocks of weight rows
  (`SixteenBitProducts`, `ROW_BLOCKS`).
- `graph_edits`: what those passes share (a product's input rows in memory, constants made from a weight, the
  product as blocked sums).
- `sampling`: the next token, greedy or through transformers' logits warpers (`sampling_warpers`,
  `choose_tokens`).
- `rows`: the server's steps (`RowDecoder`) over a cache of independent rows (`RowCache`).
- `int8`: int8 decoder layers and LM head (`quantize_weights_int8`, their activations' dtype for the CPU
  `int8_activations_dtype`), multiplied by int8 activations over several rows (`int8_activation_products`) and,
  with float32 activations, one row as sums over words of four values (`Int8RowSums`).
- `fbgemm`: products over fbgemm's packed weights for steps of several rows and the compiled decoders' prompts (the
  op `minimind::fbgemm_product`, `packed_weight`, `PackedProduct`); 16-bit weights as float16 where torch's kernels
  stop at AVX2 (`float16_rows_products`).
- `onednn`: fp32 products of several rows through oneDNN over the model's own weights where MKL runs slow (not on
  Intel CPUs): the compiled decoders' prompts (`onednn_products`, `OneDnnLinear`, `OneDnnSwiGLU`).
- `widened`: float32 arithmetic for the eager model's prompts over 16-bit weights on a CPU without 16-bit arithmetic
  (`widen_products`, `WidenedLinear`).
"""

from minimind.decode.attention import GROUPED_QUERY_SDPA, grouped_query_sdpa
from minimind.decode.attention import _attends_written_part as _attends_written_part  # read by the tests
from minimind.decode.compiled import CACHE_BUCKET, CompiledDecoder, CompiledStep, cache_length
from minimind.decode.fbgemm import Float16RowsProduct, float16_rows_products
from minimind.decode.fp32_products import (
    INTEL_CPU,
    ONEDNN_MIN_ROWS,
    Fp32Products,
    fp32_product_kernel,
)
from minimind.decode.int8 import Int8RowSums, int8_activation_products, int8_activations_dtype, quantize_weights_int8
from minimind.decode.onednn import OneDnnLinear, OneDnnSwiGLU, onednn_products
from minimind.decode.rows import RowCache, RowDecoder
from minimind.decode.sampling import choose_tokens, sampling_warpers
from minimind.decode.sixteen_bit_products import ROW_BLOCKS, SixteenBitProducts
from minimind.decode.widened import WIDEN_MIN_ROWS, WidenedLinear, widen_products

__all__ = [
    "CACHE_BUCKET",
    "GROUPED_QUERY_SDPA",
    "INTEL_CPU",
    "ONEDNN_MIN_ROWS",
    "ROW_BLOCKS",
    "WIDEN_MIN_ROWS",
    "CompiledDecoder",
    "CompiledStep",
    "Float16RowsProduct",
    "Fp32Products",
    "Int8RowSums",
    "OneDnnLinear",
    "OneDnnSwiGLU",
    "RowCache",
    "RowDecoder",
    "SixteenBitProducts",
    "WidenedLinear",
    "cache_length",
    "choose_tokens",
    "float16_rows_products",
    "fp32_product_kernel",
    "grouped_query_sdpa",
    "int8_activation_products",
    "int8_activations_dtype",
    "onednn_products",
    "quantize_weights_int8",
    "sampling_warpers",
    "widen_products",
]
