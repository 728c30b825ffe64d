"""The next token of each row: the best one, or sampled through transformers' own logits warpers, built as
`generate` builds them."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def sampling_warpers(do_sample, temperature, top_k, top_p) -> LogitsProcessorList | None:
    """transformers' own logits warpers for these settings, as `generate` builds them; None for greedy."""
    if not do_sample:
        return None
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def choose_tokens(ids, logits, warpers):
    """The next token of each row [N, 1] from its logits [N, V]: the best one, or sampled through `warpers`."""
    logits = logits.float()
    if warpers is None:
        return logits.argmax(dim=-1, keepdim=True)
    scores = warpers(ids, logits)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
