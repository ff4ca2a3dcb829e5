"""EarlyExitCache: the decoder's self-attention cache when tokens leave the layer stack early.

Every layer keeps one slot per token for every row, so all layers stay aligned with layer 0 and everything in
`generate` that reads the cache length, reorders beams or crops keeps working. At each decoding step the decoder
opens the new slots in every layer (`open_slots`); a layer fills its slots for the rows it runs on (`write`), and
when a row exits, the cache fills that row's slots in the layers it skipped, by the `kv_strategy`:

- `propagate` (CALM): each skipped layer's own pre-LN + k/v projections of the exited hidden state;
- `copy` (what the official MuE code meant to do): the exit layer's K/V, copied;
- `recompute` (DEED): nothing yet; the slot remembers the exited state and the first layer it still needs
  (`pending` / `frontier`). When a later token of that row reaches that layer, the decoder first runs the layer on
  the waiting states (`pending_inputs` -> layer -> `advance`), so the finished K/V equal a full-depth pass.

The cache never imports the model: `propagate` asks the decoder for the projections through a callable.
"""

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

KV_STRATEGIES = ("propagate", "copy", "recompute")


class EarlyExitCache(DynamicCache):
    """A `DynamicCache` with aligned per-token slots and a strategy for the layers an exited token skipped.

    Slots are addressed either by a slice of the newest positions (the tokens of this step) or, for `recompute`'s
    catch-up, by an index tensor [rows, queries] where -1 marks padding.
    """

    def __init__(self, config: PreTrainedConfig, kv_strategy: str = "propagate"):
        if kv_strategy not in KV_STRATEGIES:
            raise ValueError(f"Unknown `kv_strategy` {kv_strategy!r}; choose one of {list(KV_STRATEGIES)}.")
        # One plain layer per decoder layer. `DynamicCache(config=...)` would find the same by deep-copying the config
        # (`get_text_config`), about a millisecond per `generate` call on a CPU.
        super().__init__()
        self.layers = [DynamicLayer() for _ in range(config.num_hidden_layers)]
        self.kv_strategy = kv_strategy
        self.num_layers = len(self.layers)
        # recompute only: per row and slot, the first layer index still to run (num_layers = complete), and the
        # hidden state that layer takes as input.
        self.frontier: torch.Tensor | None = None  # [batch, T]
        self.pending: torch.Tensor | None = None  # [batch, T, d_model]
        # Layers that may have waiting tokens, kept in Python so that asking costs no device sync.
        self.waiting_layers: set[int] = set()
        self._derived: dict[str, Any] = {}

    def derived(self, name: str, make: Callable[[], Any]) -> Any:
        """What the model derives from its weights for this cache's decoding (`make()`), asked for on first use: the
        weights do not change within one `generate` call, so it is looked up once per call, not at every step."""
        if name not in self._derived:
            self._derived[name] = make()
        return self._derived[name]

    @property
    def is_compileable(self) -> bool:
        return False

    def open_slots(self, hidden_states: torch.Tensor, num_heads: int) -> slice:
        """Append one empty slot per new token (hidden_states [batch, q, d]) to every layer; returns their slice."""
        batch, length, width = hidden_states.shape
        start = self.get_seq_length()
        empty = hidden_states.new_zeros(batch, num_heads, length, width // num_heads)
        for layer_idx in range(self.num_layers):
            self.layers[layer_idx].update(empty, empty)
        if self.kv_strategy == "recompute":
            complete = torch.full((batch, length), self.num_layers, dtype=torch.long, device=hidden_states.device)
            waiting = hidden_states.new_zeros(batch, length, width)
            self.frontier = complete if self.frontier is None else torch.cat([self.frontier, complete], dim=1)
            self.pending = waiting if self.pending is None else torch.cat([self.pending, waiting], dim=1)
        return slice(start, start + length)

    def write(
        self,
        layer_idx: int,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: torch.Tensor | None,
        slots: slice | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V [rows, heads, q, head_dim] at `slots` of `rows` (None: every row, in order).

        Returns the layer's whole keys and values, [batch, heads, T, head_dim].
        """
        layer = self.layers[layer_idx]
        if isinstance(slots, slice):
            target = (slice(None) if rows is None else rows, slice(None), slots)
            layer.keys[target] = key
            layer.values[target] = value
        else:
            valid = slots >= 0
            row_index = rows[:, None].expand_as(slots)[valid]
            slot_index = slots[valid]
            layer.keys[row_index, :, slot_index] = key.transpose(1, 2)[valid]
            layer.values[row_index, :, slot_index] = value.transpose(1, 2)[valid]
        return layer.keys, layer.values

    def fill_skipped(
        self,
        layers_run: torch.Tensor,
        slots: slice,
        exit_outputs: torch.Tensor,
        project: Callable[[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """After a decoding step: fill the slots of the layers each row skipped. `layers_run` [batch] counts the
        layers each row ran (the depth: none skipped); `exit_outputs` [batch, q, d] holds the output of its last
        layer for the rows that stopped early. `project(first, hidden)` gives the K/V of hidden states in each layer
        from `first` to the last.

        Done once per step, not at each exit, so that a step costs one projection (propagate) or one copy per exit
        depth and skipped layer, whatever the number of rows and of layers they left at."""
        depth = self.num_layers
        by_depth: dict[int, list[int]] = {}
        for row, ran in enumerate(layers_run.tolist()):  # one host sync per step
            if ran < depth:
                by_depth.setdefault(ran, []).append(row)
        if not by_depth:
            return
        batch, device = layers_run.shape[0], layers_run.device

        def index(rows: list[int]) -> torch.Tensor | None:  # None: every row, in order (no gathers)
            return None if len(rows) == batch else torch.tensor(sorted(rows), device=device)

        if self.kv_strategy == "propagate":
            exited = sorted(row for group in by_depth.values() for row in group)
            rows = index(exited)
            first = min(by_depth)
            key_values = project(first, exit_outputs if rows is None else exit_outputs[rows])  # layers first..
            skipping: set[int] = set()  # the rows that skip layer_idx: those that ran at most layer_idx layers
            for layer_idx, (key, value) in enumerate(key_values, start=first):
                skipping.update(by_depth.get(layer_idx, []))
                if len(skipping) < len(exited):  # the rows that exited deeper ran this layer themselves
                    picked = torch.tensor([i for i, row in enumerate(exited) if row in skipping], device=device)
                    key, value = key[picked], value[picked]
                self.write(layer_idx, key, value, index(skipping), slots)
        elif self.kv_strategy == "copy":
            for ran, group in by_depth.items():
                rows = index(group)
                exit_layer = self.layers[ran - 1]
                row_index = slice(None) if rows is None else rows
                key, value = exit_layer.keys[row_index, :, slots], exit_layer.values[row_index, :, slots]
                for layer_idx in range(ran, depth):
                    self.write(layer_idx, key, value, rows, slots)
        else:
            rows = torch.tensor(sorted(row for group in by_depth.values() for row in group), device=device)
            self.frontier[rows, slots] = layers_run[rows, None]  # each waits for the first layer it skipped
            self.pending[rows, slots] = exit_outputs[rows].to(self.pending.dtype)
            self.waiting_layers.update(by_depth)

    def pending_inputs(
        self, layer_idx: int, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """recompute: of `rows`, those with tokens waiting for layer `layer_idx`, their waiting hidden states
        [rows', P, d] and slots [rows', P] (chronological, -1 = padding), or None when nothing waits."""
        if layer_idx not in self.waiting_layers:
            return None
        waiting = self.frontier[rows] == layer_idx  # [rows, T]
        counts = waiting.sum(dim=-1)
        width = int(counts.max())
        if width == 0:
            if not bool((self.frontier == layer_idx).any()):  # no row at all waits here any more
                self.waiting_layers.discard(layer_idx)
            return None
        has_pending = counts > 0
        rows, waiting, counts = rows[has_pending], waiting[has_pending], counts[has_pending]
        # Waiting slots first, each group in chronological order (a stable sort of "not waiting").
        order = torch.sort((~waiting).to(torch.int8), dim=-1, stable=True).indices[:, :width]
        valid = torch.arange(width, device=order.device)[None] < counts[:, None]
        slots = torch.where(valid, order, -1)
        return rows, self.pending[rows[:, None], order], slots

    def advance(self, layer_idx: int, rows: torch.Tensor, slots: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """recompute: layer `layer_idx` ran on the waiting tokens; they now wait for the next layer."""
        valid = slots >= 0
        row_index = rows[:, None].expand_as(slots)[valid]
        slot_index = slots[valid]
        self.pending[row_index, slot_index] = hidden_states[valid].to(self.pending.dtype)
        self.frontier[row_index, slot_index] = layer_idx + 1
        if layer_idx + 1 < self.num_layers:
            self.waiting_layers.add(layer_idx + 1)

    # The side buffers follow every batch and length operation of the K/V.

    def _map_side_buffers(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.frontier is not None:
            self.frontier, self.pending = function(self.frontier), function(self.pending)

    def reset(self) -> None:
        super().reset()
        self.frontier = self.pending = None
        self.waiting_layers = set()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_side_buffers(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0:
            self._map_side_buffers(lambda t: t[:, :tokens_to_remove])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_side_buffers(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_side_buffers(lambda t: t[indices])


__all__ = ["EarlyExitCache", "KV_STRATEGIES"]
