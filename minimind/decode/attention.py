"""`grouped_query_sdpa`, the attention of the compiled decode steps: each key/value head attended once for all the
query heads it serves, and the static cache read only as far as it has been written. Registered with transformers
under the name `GROUPED_QUERY_SDPA`."""

from __future__ import annotations

import torch
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
    mask; `_filled_length`). Anything else goes to transformers' kernel.
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
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)  # [B,K,G,Dh]
    return out.view(batch, 1, heads, head_dim), None  # [B, 1, H, Dh], as transformers' kernels return it


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
