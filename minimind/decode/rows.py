"""The compiled step for a server (`minimind.serving.CompiledBatchEngine`): `RowDecoder` over a `RowCache`, whose
rows are independent sequences, each at its own position, so sequences join and leave between steps."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from minimind.decode.compiled import CompiledStep
from minimind.decode.memory import lazy_zeros


class _RowLayer(StaticLayer):
    """One layer of a `RowCache`: a step writes each row's key and value at that row's own position."""

    def __init__(self, keys, values, positions):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.positions = keys, values, positions
        self.batch_size, self.num_heads, _, self.k_head_dim = keys.shape
        self.v_head_dim, self.device, self.is_initialized = values.shape[-1], keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):  # [R, K, 1, Dh] each
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.keys[rows, :, self.positions] = key_states[:, :, 0]
        self.values[rows, :, self.positions] = value_states[:, :, 0]
        return self.keys, self.values  # [R, K, L, Dh]


class RowCache(Cache):
    """A static KV cache whose rows are independent sequences, each at its own position: what a server batching
    requests that arrive at different times needs (transformers' `StaticCache` keeps one position for the whole
    batch). `positions[r]` is where row r's next token goes; a prompt enters a row through `fill_row`, and
    `first(n)` is the same memory seen as its first n rows, so a step runs only as many rows as are busy."""

    def __init__(self, config, rows: int, length: int, dtype, device, _tensors=None):
        self.config = config
        if _tensors is None:
            shape = (config.num_hidden_layers, rows, config.num_key_value_heads, length, config.head_dim)
            # every row for the whole context, on a CPU resident only where rows have been written
            _tensors = (
                lazy_zeros(shape, dtype, device),
                lazy_zeros(shape, dtype, device),
                torch.zeros(rows, dtype=torch.long, device=device),
            )
        # [layers, R, K, L, Dh] twice (or, in a step being exported, a [R, K, L, Dh] tensor per layer), [R]
        self.keys, self.values, self.positions = _tensors
        super().__init__(layers=[_RowLayer(k, v, self.positions) for k, v in zip(self.keys, self.values)])

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def first(self, rows: int) -> RowCache:
        return RowCache(
            self.config,
            rows,
            self.length,
            None,
            None,
            _tensors=(self.keys[:, :rows], self.values[:, :rows], self.positions[:rows]),
        )

    def fill_row(self, row: int, prompt_cache: DynamicCache, index: int, length: int) -> None:
        """Row `row` takes the first `length` keys and values of sequence `index` of a prompt batch's cache."""
        for layer, prompt_layer in enumerate(prompt_cache.layers):
            self.keys[layer, row, :, :length] = prompt_layer.keys[index, :, :length]
            self.values[layer, row, :, :length] = prompt_layer.values[index, :, :length]
        self.positions[row] = length

    def move_row(self, source: int, target: int) -> None:
        """Row `target` takes over row `source`'s sequence (what has been written of it)."""
        written = int(self.positions[source])
        self.keys[:, target, :, :written] = self.keys[:, source, :, :written]
        self.values[:, target, :, :written] = self.values[:, source, :, :written]
        self.positions[target] = written


class RowDecoder(CompiledStep):
    """Decode steps over a `RowCache`: row r takes token r at its own position and sees only its own sequence.
    The step is compiled once per number of rows (the same inductor settings as `CompiledDecoder`'s, the same
    `grouped_query_sdpa`, which reads the cache only as far as the furthest row has written), so sequences can
    join and leave between steps without recompiling."""

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: RowCache, rows: list[int]):
        """The prompts run eagerly in one forward and prompt i's keys and values go to row `rows[i]`. Returns each
        prompt's last logits [N, V]. The prompts are right-padded to the longest: attention is causal, so no real
        token sees the padding after it, and each prompt's own positions are exact. One forward over N prompts
        costs far less than N."""
        lengths = torch.tensor([len(ids) for ids in prompts], device=self.model.device)
        longest = int(lengths.max())
        ids = torch.tensor([ids + [ids[-1]] * (longest - len(ids)) for ids in prompts], device=self.model.device)
        prompt_cache = DynamicCache(config=self.model.config)
        model = self.prompt_model(ids.numel())
        hidden = model.model(input_ids=ids, cache=prompt_cache, use_cache=True).last_hidden_state  # [N, T, D]
        last = hidden[torch.arange(len(prompts), device=hidden.device), lengths - 1]  # [N, D]
        for index, (row, length) in enumerate(zip(rows, lengths.tolist())):
            cache.fill_row(row, prompt_cache, index, length)
        return model.lm_head(last)  # [N, V]

    @torch.no_grad()
    def step(self, tokens, cache: RowCache):
        """tokens [R, 1] at `cache.positions` -> logits [R, V]; the caller moves the positions of busy rows on."""
        return self._next_logits(tokens, cache.positions, cache)

    def _cache_state(self, cache):  # the positions are the step's `position`
        # A tensor per layer, as the package's inputs: a step that writes into one [layers, ...] input gets every
        # layer's write functionalised into a copy of that layer's whole cache, and the copy back, on every step.
        return [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]

    def _cache_over(self, cache, position, state):
        layers = len(state) // 2
        return RowCache(
            cache.config,
            position.shape[0],
            cache.length,
            None,
            None,
            _tensors=(state[:layers], state[layers:], position),
        )

    def _forward_one(self, token, position, cache):  # token [R, 1], position [R]
        seen = torch.arange(cache.length, device=position.device)[None, :] <= position[:, None]  # [R, L]
        out = self.model_for(token.shape[0])(
            input_ids=token,
            position_ids=position[:, None],
            attention_mask=seen[:, None, None, :],
            cache=cache,
            use_cache=True,
        )
        return out.logits[:, -1]  # [R, V]
