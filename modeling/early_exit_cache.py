"""EarlyExitCache: the decoder's self-attention cache when tokens leave the layer stack early.

Every layer keeps one slot per token for every row, so all layers stay aligned with layer 0 and everything in
`generate` that reads the cache length, reorders beams or crops keeps working. At each decoding step the decoder
opens the new slots in every layer (`open_slots`); a layer fills its slots for the rows it runs on (`write`), and
when a row exits, the cache records the slots it left empty in the layers it skipped (`record_skipped`). They are
filled by the `kv_strategy`:

- `propagate` (CALM): each skipped layer's own pre-LN + k/v projections of the exited hidden state;
- `copy` (what the official MuE code meant to do): the exit layer's K/V, copied;
- `recompute` (DEED): the slot remembers the exited state and the first layer it still needs (`pending` /
  `frontier`). When a later token of that row reaches that layer, the decoder first runs the layer on the waiting
  states (`pending_inputs` -> layer -> `advance`), so the finished K/V equal a full-depth pass.

Each step's new slots are views of buffers with room for more (`Room`): growing by one token does not copy the
whole cache per layer, as a `DynamicCache`'s concatenation does (at batch 16 on a CPU, fresh allocations of that size
cost more than the copy).

`propagate` and `copy` fill late too: only when a later token is about to run a layer that an earlier token
skipped (`fill_skipped(layer_idx)`). The slots no later token reads are never filled: those of the last token, and
all of them when the tokens after stop at the same depth or shallower (a short answer: its end-of-sequence token
stops at the first exit). `fill_skipped()` fills everything recorded, for a caller that reads the cache itself.

The cache never imports the model: `propagate` asks the decoder for the projections through a callable.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer

from .exit_knobs import KV_STRATEGIES


@dataclass
class Room:
    """A buffer that a cache tensor is a prefix view of along `dim`, with room for more slots: `view`, the last view it
    gave. Its slots from `used` on are zeros: no view has shown them since it was made."""

    buffer: torch.Tensor
    dim: int
    used: int = 0
    view: torch.Tensor | None = None

    def across(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` has the buffer's dimensions but `dim`."""
        dim = self.dim
        return self.buffer.shape[:dim] == shape[:dim] and self.buffer.shape[dim + 1 :] == shape[dim + 1 :]

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a tensor of `shape` fits: the same dimensions but `dim`, no longer, the same dtype and device."""
        buffer = self.buffer
        return (
            self.across(shape)
            and shape[self.dim] <= buffer.shape[self.dim]
            and buffer.dtype == dtype
            and buffer.device == device
        )

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a prefix view of the buffer (a crop of a view it gave), not a tensor that a batch
        operation or a device move put in its place."""
        buffer = self.buffer
        same_start = tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
        return same_start and self.across(tensor.shape)

    def shares_memory(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()


def grown(
    tensor: torch.Tensor | None,
    room: Room | None,
    shape: tuple[int, ...],
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    fill: int = 0,
) -> tuple[torch.Tensor, Room]:
    """`tensor` (None or empty: nothing yet) followed by new slots holding `fill`, `shape` in all, as a view of a buffer
    with room for more. The buffer is `room` when `tensor` is its prefix view, or when a batch operation put a tensor
    of the same shape in its place that shares no memory with it (whose values are copied in); a new one twice as
    long otherwise. Returns (the view, its room)."""
    if room is not None and tensor is room.view and shape[dim] <= room.buffer.shape[dim]:
        old = tensor.shape[dim]  # the common step: the room's last view, untouched since, grows in place
    else:
        old = 0 if tensor is None or tensor.numel() == 0 else tensor.shape[dim]
        fits = room is not None and room.fits(shape, dtype, device)
        if not (fits and old and room.holds(tensor)):
            if not fits or (old and room.shares_memory(tensor)):
                capacity = (*shape[:dim], max(2 * shape[dim], 16), *shape[dim + 1 :])
                room = Room(torch.zeros(capacity, dtype=dtype, device=device), dim)
            if old:
                room.buffer.narrow(dim, 0, old).copy_(tensor)
    if old < room.used:  # slots a crop gave back: zeros again, as fresh ones are, all at once
        room.buffer.narrow(dim, old, room.used - old).zero_()
        room.used = old
    if fill:
        room.buffer.narrow(dim, old, shape[dim] - old).fill_(fill)
    room.used = max(room.used, shape[dim])
    room.view = room.buffer.narrow(dim, 0, shape[dim])
    return room.view, room


def selected_first(selected: torch.Tensor, counts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the slots `selected` [rows, T] (`counts` [rows] of them) first, each group in order (a stable sort of
    "not selected"), the first `width`: their indices [rows, width], and which of them are selected."""
    order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices[:, :width]
    return order, torch.arange(width, device=order.device)[None] < counts[:, None]


def scattered_slots(rows: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row `slots` [rows, q] (-1: none) of the cache `rows` -> (which entries are slots [rows, q], then the row
    and the slot of each of them): the index of a write at each row's own slots."""
    valid = slots >= 0
    return valid, rows[:, None].expand_as(slots)[valid], slots[valid]


@dataclass
class SkippedSlots:
    """One step's slots that rows left empty (`propagate` / `copy`), to fill when a later token needs them.

    slots: the step's positions. layers_run [batch]: the layers each row ran (the depth: none skipped).
    exit_outputs [batch, q, d]: the output of each early-stopped row's last layer. shallowest: the fewest layers a row
    ran when the step was recorded, i.e. the first layer index with an empty slot (a beam reordering can only raise
    it). project: the decoder's K/V of exited states per layer. ran: `layers_run` on the host, until a batch operation
    moves its rows (reading it again is a device sync on a GPU). grad: whether the step ran with grad, as its fill
    does, whoever calls it.
    """

    slots: slice
    layers_run: torch.Tensor
    exit_outputs: torch.Tensor
    shallowest: int
    project: Callable[[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]
    ran: list[int] | None = None
    grad: bool = False


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
        # propagate / copy: the steps whose empty slots are not filled yet, oldest first.
        self.skipped: list[SkippedSlots] = []
        # [batch]: the rows that `generate`'s greedy and sampling loop has ended (`end_rows`); None outside it.
        self.ended: torch.Tensor | None = None
        self._derived: dict[str, Any] = {}
        # Per cache tensor (keys and values of each layer, `frontier`, `pending`), the buffer it is a view of.
        self._rooms: dict[object, Room] = {}

    def derived(self, name: str, make: Callable[[], Any], fits: Callable[[Any], bool] | None = None) -> Any:
        """What the model derives from its weights for this cache's decoding (`make()`), made on first use and again
        when the kept one no longer `fits` the step. The weights do not change within one `generate` call, and they
        may between calls (an optimizer step, a merged adapter, weights written through `.data`), so it lives as
        long as the call's cache."""
        if name not in self._derived or (fits is not None and not fits(self._derived[name])):
            self._derived[name] = make()
        return self._derived[name]

    def end_rows(self, done: torch.Tensor) -> None:
        """The rows [batch] that the loop's stopping check ended after a step, besides those it ended before: from the
        next step on they are fed their last token, then padding, and their tokens are thrown away."""
        self.ended = done if self.ended is None else self.ended | done

    @property
    def is_compileable(self) -> bool:
        return False

    def open_slots(self, hidden_states: torch.Tensor, num_heads: int) -> slice:
        """Append one empty slot per new token (hidden_states [batch, q, d]) to every layer; returns their slice."""
        batch, length, width = hidden_states.shape
        start = self.get_seq_length()
        dtype, device = hidden_states.dtype, hidden_states.device
        shape = (batch, num_heads, start + length, width // num_heads)
        for layer_idx, layer in enumerate(self.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(hidden_states, hidden_states)
            for name in ("keys", "values"):
                key = (name, layer_idx)
                tensor, self._rooms[key] = grown(getattr(layer, name), self._rooms.get(key), shape, 2, dtype, device)
                setattr(layer, name, tensor)
        if self.kv_strategy == "recompute":
            slots = (batch, start + length)
            self.frontier, self._rooms["frontier"] = grown(
                self.frontier, self._rooms.get("frontier"), slots, 1, torch.long, device, fill=self.num_layers
            )
            self.pending, self._rooms["pending"] = grown(
                self.pending, self._rooms.get("pending"), (*slots, width), 1, dtype, device
            )
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
            valid, row_index, slot_index = scattered_slots(rows, slots)
            layer.keys[row_index, :, slot_index] = key.transpose(1, 2)[valid]
            layer.values[row_index, :, slot_index] = value.transpose(1, 2)[valid]
        return layer.keys, layer.values

    def record_skipped(
        self,
        layers_run: torch.Tensor,
        ran: list[int],
        slots: slice,
        exit_outputs: torch.Tensor,
        project: Callable[[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """After a decoding step: record the slots of the layers each row skipped. `layers_run` [batch] counts the
        layers each row ran (the depth: none skipped), `ran` holds it on the host; `exit_outputs` [batch, q, d] holds
        the output of its last layer for the rows that stopped early. `project(first, hidden)` gives the K/V of hidden
        states in each layer from `first` to the last."""
        shallowest = min(ran)
        if shallowest >= self.num_layers:
            return
        if self.kv_strategy == "recompute":
            exited = [row for row, count in enumerate(ran) if count < self.num_layers]
            # Every row exited (always so at batch 1): a slice, no gathers.
            rows = slice(None) if len(exited) == len(ran) else torch.tensor(exited, device=layers_run.device)
            self.frontier[rows, slots] = layers_run[rows, None]  # each waits for the first layer it skipped
            self.pending[rows, slots] = exit_outputs[rows].to(self.pending.dtype)
            self.waiting_layers.update(ran[row] for row in exited)
            return
        self.skipped.append(
            SkippedSlots(slots, layers_run, exit_outputs, shallowest, project, ran, torch.is_grad_enabled())
        )

    def fill_skipped(self, layer_idx: int | None = None) -> None:
        """`propagate` / `copy`: fill the recorded steps that left layer `layer_idx` empty for a row, each in all the
        layers it skipped (None: every recorded step). The decoder asks before each layer it runs; a few Python
        comparisons when nothing is due."""
        due, waiting = [], []
        for step in self.skipped:
            (due if layer_idx is None or step.shallowest <= layer_idx else waiting).append(step)
        if due:
            self.skipped = waiting
            for step in due:
                with torch.set_grad_enabled(step.grad):
                    self.fill_step(step)

    def fill_step(self, step: SkippedSlots) -> None:
        """Fill one step's empty slots: one projection (propagate) or one copy per exit depth and skipped layer,
        whatever the number of rows and of layers they left at."""
        depth, slots = self.num_layers, step.slots
        by_depth: dict[int, list[int]] = {}
        for row, ran in enumerate(step.layers_run.tolist() if step.ran is None else step.ran):
            if ran < depth:
                by_depth.setdefault(ran, []).append(row)
        if not by_depth:  # the beams that skipped were dropped by a reordering
            return
        batch, device = step.layers_run.shape[0], step.layers_run.device

        def index(rows: list[int]) -> torch.Tensor | None:  # None: every row, in order (no gathers)
            return None if len(rows) == batch else torch.tensor(sorted(rows), device=device)

        if self.kv_strategy == "propagate":
            exited = sorted(row for group in by_depth.values() for row in group)
            rows = index(exited)
            first = min(by_depth)
            key_values = step.project(first, step.exit_outputs if rows is None else step.exit_outputs[rows])
            skipping: set[int] = set()  # the rows that skip layer_idx: those that ran at most layer_idx layers
            for layer_idx, (key, value) in enumerate(key_values, start=first):
                skipping.update(by_depth.get(layer_idx, []))
                if len(skipping) < len(exited):  # the rows that exited deeper ran this layer themselves
                    picked = torch.tensor([i for i, row in enumerate(exited) if row in skipping], device=device)
                    key, value = key[picked], value[picked]
                self.write(layer_idx, key, value, index(skipping), slots)
        else:
            for ran, group in by_depth.items():
                rows = index(group)
                exit_layer = self.layers[ran - 1]
                row_index = slice(None) if rows is None else rows
                key, value = exit_layer.keys[row_index, :, slots], exit_layer.values[row_index, :, slots]
                for layer_idx in range(ran, depth):
                    self.write(layer_idx, key, value, rows, slots)

    def pending_inputs(
        self, layer_idx: int, rows: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | slice] | None:
        """recompute: of `rows`, those with tokens waiting for layer `layer_idx`, their waiting hidden states
        [rows', P, d] and slots [rows', P] (chronological, -1 = padding), or None when nothing waits. When every row
        of the batch waits at the same last P slots (a speculative round's verification at batch 1, a step after a
        shared exit), the rows are None and the slots a slice: no gathers."""
        if layer_idx not in self.waiting_layers:
            return None
        waiting = self.frontier[rows] == layer_idx  # [rows, T]
        counts = waiting.sum(dim=-1)
        width = int(counts.max())
        if width == 0:
            if not bool((self.frontier == layer_idx).any()):  # no row at all waits here any more
                self.waiting_layers.discard(layer_idx)
            return None
        length = waiting.shape[1]
        # Every row waiting at all of the last `width` slots means every row waits exactly there (no row waits more).
        if len(rows) == self.frontier.shape[0] and bool(waiting[:, length - width :].all()):
            return None, self.pending[:, length - width :], slice(length - width, length)
        has_pending = counts > 0
        rows, waiting, counts = rows[has_pending], waiting[has_pending], counts[has_pending]
        order, valid = selected_first(waiting, counts, width)
        slots = torch.where(valid, order, -1)
        return rows, self.pending[rows[:, None], order], slots

    def catch_up_plan(self, first: int) -> list[list[int]]:
        """recompute: per row, the first layer each slot from `first` on still waits for (`num_layers`: none), in one
        device read. A pass that runs every waiting token up to the last layer (a speculative round's
        verification) knows from it which tokens wait for each layer (`planned_inputs`) without reading again."""
        return self.frontier[:, first:].tolist()

    def planned_inputs(
        self, layer_idx: int, plan: list[list[int]], first: int
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | slice] | None:
        """`pending_inputs` of every row at layer `layer_idx` during a pass that runs each waiting token to the last
        layer, from its `catch_up_plan` taken at slot `first` before it began: a token waits for this layer when it
        waited for this one or an earlier one then."""
        offsets = [[offset for offset, layer in enumerate(layers) if layer <= layer_idx] for layers in plan]
        width = max(len(row) for row in offsets)
        if width == 0:
            return None
        length = first + len(plan[0])
        if all(row == list(range(length - first - width, length - first)) for row in offsets):
            return None, self.pending[:, length - width :], slice(length - width, length)
        rows = [row for row, waiting in enumerate(offsets) if waiting]
        device = self.frontier.device
        slots = torch.tensor(
            [[first + offset for offset in offsets[row]] + [-1] * (width - len(offsets[row])) for row in rows],
            device=device,
        )
        index = torch.tensor(rows, device=device)
        return index, self.pending[index[:, None], slots.clamp(min=0)], slots

    def wait(self, slots: slice, hidden_states: torch.Tensor) -> None:
        """recompute: the tokens at `slots` (just opened) wait for the first layer, with input `hidden_states`
        [batch, q, d]: the next catch-ups run every layer on them."""
        self.frontier[:, slots] = 0
        self.pending[:, slots] = hidden_states.to(self.pending.dtype)
        self.waiting_layers.add(0)

    def advance(
        self, layer_idx: int, rows: torch.Tensor | None, slots: torch.Tensor | slice, hidden_states: torch.Tensor
    ) -> None:
        """recompute: layer `layer_idx` ran on the waiting tokens; they now wait for the next layer."""
        if isinstance(slots, slice):  # every row, the same slots
            self.pending[:, slots] = hidden_states.to(self.pending.dtype)
            self.frontier[:, slots] = layer_idx + 1
        else:
            valid, row_index, slot_index = scattered_slots(rows, slots)
            self.pending[row_index, slot_index] = hidden_states[valid].to(self.pending.dtype)
            self.frontier[row_index, slot_index] = layer_idx + 1
        if layer_idx + 1 < self.num_layers:
            self.waiting_layers.add(layer_idx + 1)

    # The side buffers follow every batch and length operation of the K/V.

    def _map_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation (on dim 0) to the K/V and every buffer kept beside them."""
        for layer_idx, layer in enumerate(self.layers):
            if layer.get_seq_length() > 0:
                layer.keys = self._rows_mapped(("keys", layer_idx), layer.keys, function)
                layer.values = self._rows_mapped(("values", layer_idx), layer.values, function)
        if self.frontier is not None:
            self.frontier = self._rows_mapped("frontier", self.frontier, function)
            self.pending = self._rows_mapped("pending", self.pending, function)
        for step in self.skipped:
            step.layers_run, step.exit_outputs, step.ran = function(step.layers_run), function(step.exit_outputs), None
        if self.ended is not None:
            self.ended = function(self.ended)

    def _rows_mapped(
        self, key: object, tensor: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """`function(tensor)`; applied to the whole buffer where `tensor` is its room's last view, so that the next step
        still grows in place: a new buffer per tensor after each beam reordering or batch selection cost a step ten
        times its usual `open_slots` on a CPU."""
        room = self._rooms.get(key)
        if room is None or tensor is not room.view:
            return function(tensor)
        room.buffer = function(room.buffer)
        room.view = room.buffer.narrow(room.dim, 0, tensor.shape[room.dim])
        return room.view

    def reset(self) -> None:
        super().reset()
        self.frontier = self.pending = self.ended = None
        self.waiting_layers = set()
        self.skipped = []
        self._rooms = {}
        self._derived = {}  # a reset cache may serve weights changed since

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove >= 0:
            return
        if self.frontier is not None:
            self.frontier, self.pending = self.frontier[:, :tokens_to_remove], self.pending[:, :tokens_to_remove]
        length = self.get_seq_length()
        self.skipped = [step for step in self.skipped if step.slots.start < length]
        for step in self.skipped:  # a step that straddles the new end keeps its first positions
            stop = min(step.slots.stop, length)
            step.exit_outputs = step.exit_outputs[:, : stop - step.slots.start]
            step.slots = slice(step.slots.start, stop)

    def close_holes(self, real: torch.Tensor, inputs: torch.Tensor | None = None) -> None:
        """Keep each row's real slots (`real` [batch, T], 1 = real) in their order at its first positions, as a cache
        without holes holds them; the cache shrinks to the most real slots a row has. The slots after a row's last
        real one hold zeros, or with `recompute` wait for the first layer with `inputs` [batch, T', d] (the first
        layer's inputs of the tokens there), so that the next call that reads them runs the layers on them first.
        Speculative decoding leaves holes where rows rejected drafts."""
        self.fill_skipped()  # recorded steps address slots by position: fill them before the positions move
        counts = real.sum(dim=-1)
        length = int(counts.max())
        order, valid = selected_first(real.bool(), counts, length)
        rows, dropped = torch.arange(len(order), device=order.device)[:, None], ~valid

        # Indexing copies whole head_dim rows: a `gather` with a broadcast index took twice as long on a CPU.
        def kept(keys: torch.Tensor) -> torch.Tensor:  # [batch, heads, T, head_dim]: `order`, zeros where dropped
            return keys[rows, :, order].masked_fill_(dropped[..., None, None], 0).transpose(1, 2)

        for layer in self.layers:
            layer.keys, layer.values = kept(layer.keys), kept(layer.values)
        if self.frontier is None:
            return
        waits = inputs is not None and not bool(valid.all())
        self.frontier = self.frontier[rows, order].masked_fill_(dropped, 0 if waits else self.num_layers)
        filler = inputs[:, :length].to(self.pending.dtype) if waits else 0
        self.pending = torch.where(valid[..., None], self.pending[rows, order], filler)
        if waits:
            self.waiting_layers.add(0)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices])


__all__ = ["EarlyExitCache", "SkippedSlots"]
