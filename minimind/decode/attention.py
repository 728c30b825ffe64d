"""`grouped_query_sdpa`, the attention of the compiled decode steps: each key/value head attended once for all the
query heads it serves, and the static cache read only as far as it has been written. Registered with transformers
under the name `GROUPED_QUERY_SDPA`."""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def grouped_query_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA that, for one query position, attends each key/value head once for all the query heads it serves.

    transformers' SDPA kernel copies every key/value head `num_attention_heads / num_key_value_heads` times
    whenever there is a mask (a static cache always has one) before attending: for a decode step that is a copy
    of the whole cache per layer, larger than the attention itself. With one query position the G query heads
    of a group are G rows against the same keys, so q [B, H, 1, Dh] is viewed as [B, K, G, Dh] and attends the
    cache as it is (the mask [B, 1, 1, S] broadcasts over the rows), up to the last position a row sees (a bool
    mask; `_filled_length`). In a graph being compiled for the CPU it is written out as sums (`summed_attention`),
    which inductor fuses into the step's own kernel. Anything else goes to transformers' kernel.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # [B, K, G, Dh]
    if _attends_written_part(attention_mask):
        filled = _filled_length(attention_mask)
        key, value, attention_mask = key[:, :, :filled], value[:, :, :filled], attention_mask[..., :filled]
    bool_mask = attention_mask is None or attention_mask.dtype == torch.bool
    if torch.compiler.is_compiling() and query.device.type == "cpu" and bool_mask:
        scale = head_dim**-0.5 if scaling is None else scaling
        out = summed_attention(grouped, key, value, attention_mask, scale).to(query.dtype)  # [B, K, G, Dh]
    else:
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.view(batch, 1, heads, head_dim), None  # [B, 1, H, Dh], as transformers' kernels return it


def summed_attention(query, key, value, mask, scale):
    """softmax(query . key * scale) . value in fp32, written as sums over the head dimension and over the keys
    (query [B, K, G, Dh], key and value [B, K, S, Dh], mask bool [B, 1, 1, S] or None; -> fp32 [B, K, G, Dh]).

    Inside a compiled CPU step SDPA is an external call with its own threads and buffers, which for one query
    position against a few hundred keys costs more than the attention's arithmetic; as sums, inductor computes it
    inside the kernel that runs the layer's products, between them (docs/performance.md, "Fast decode on a CPU").
    The query is computed into memory first: inductor would otherwise recompute its norm and rotation, sines and
    cosines included, for every key it meets."""
    query = query.float()
    query = torch.ops.prims.inductor_force_stride_order.default(query, [int(size) for size in query.stride()])
    scores = (query.unsqueeze(3) * key.float().unsqueeze(2)).sum(-1) * scale  # [B, K, G, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(-1)  # [B, K, G, S]
    return (weights.unsqueeze(-1) * value.float().unsqueeze(2)).sum(-2)  # [B, K, G, Dh]


def _filled_length(mask):
    """One past the last cache position any row sees (mask: bool [B, 1, 1, S]). A static cache is longer than what
    has been written, up to a whole `CACHE_BUCKET` ahead, and attending only up to here leaves the unwritten keys
    and values unread. The length is data: a compiled step reads it as a scalar, so one graph serves every step
    of a bucket."""
    seen = mask.reshape(-1, mask.shape[-1]).any(dim=0)  # [S]
    filled = (seen.shape[0] - seen.flip(0).to(torch.uint8).argmax()).item()  # all False: the whole cache
    torch._check(filled >= 1)
    torch._check(filled <= seen.shape[0])
    return filled


def _attends_written_part(mask) -> bool:
    """Whether the grouped kernel cuts the cache at `_filled_length`: for a bool mask on the CPU (on a GPU reading
    the length would stop the host for the device in every layer, and nothing was measured there), eagerly
    always, and in a graph being compiled only if dynamo keeps a tensor's `.item()` in the graph (which
    `CompiledDecoder` turns on) rather than breaking it there."""
    if mask is None or mask.dtype != torch.bool or mask.device.type != "cpu":
        return False
    return not torch.compiler.is_compiling() or torch._dynamo.config.capture_scalar_outputs


# transformers' own registries for custom kernels: the name selects the kernel and, as for "sdpa", SDPA's masks.
GROUPED_QUERY_SDPA = "minimind_grouped_query_sdpa"
AttentionInterface.register(GROUPED_QUERY_SDPA, grouped_query_sdpa)
AttentionMaskInterface.register(GROUPED_QUERY_SDPA, sdpa_mask)
