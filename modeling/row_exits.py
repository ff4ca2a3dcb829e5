"""The one row-exit mechanism of every layer loop (joint encoder, each encoder stream, decoder step).

A layer loop asks its controller after a layer "which running rows are ready to stop here?" and hands the answer to
`RowExits`, which records each ready row's exit layer and the state its output comes from, and gives the loop what
goes on. What happens to a ready row is the execution plan:

- `KeepPlan`: it stays in the batch and keeps flowing through the layers the batch still runs for its other rows; its
  output still comes from its exit state. A step costs what its deepest row costs, and a decoding step at batch <= 16
  reads every weight once whatever the number of rows, so this is what the hardware gives. The kept rows get the real
  K/V of every layer the batch ran, so the KV strategy fills only the layers nobody ran.
- `CompactPlan`: ready rows leave the batch and the deeper layers run on the running rows only, gathered; attention
  then reads each contiguous run of the batch's cached K/V as a view (`ActiveRows`). It pays when a layer's cost grows
  with its rows (many tokens per row: the encoder, prefill) and not otherwise (the gathers and per-run attention cost
  5-17% of a decoding step on a CPU).
- `AutoPlan`: at each stop, compacts only when the measured `LayerCosts` predict that the next layer costs clearly
  less on the rows that go on, gather included, than on the rows running now.

The loop ends when the last row is ready. Two batch-level rules change what "ready" gives: the token of a row ready
before the batch stops may come from the layer where the batch stops (`token_from_batch_layer`, CALM's rule: deeper,
at no extra cost under `KeepPlan`), and the batch may stop once a fraction of its rows is ready (`stop_fraction`, the
others stopping with them; rows whose output is thrown away count on neither side). Nothing here imports the model.
"""

import bisect
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

States = dict[str, torch.Tensor | Callable[[], torch.Tensor]]


@dataclass
class ActiveRows:
    """The rows of the batch a layer runs on: their indices, and the contiguous runs they form so that attention
    reads each run's cached K/V as a view instead of gathering them (at batch > 1 the cross-attention K/V are as
    large as a layer's weights; copying them would eat the time the exit saves)."""

    index: torch.Tensor  # [rows], ascending
    runs: list[tuple[int, int]]  # [start, end) in the batch

    @classmethod
    def of(cls, index: torch.Tensor, rows: list[int] | None = None) -> "ActiveRows":
        """`rows`: `index` on the host, where the caller knows it (reading `index` is a device sync on a GPU)."""
        runs: list[list[int]] = []
        for row in index.tolist() if rows is None else rows:
            if runs and runs[-1][1] == row:
                runs[-1][1] += 1
            else:
                runs.append([row, row + 1])
        return cls(index, [(start, end) for start, end in runs])


def select_rows(tensor: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """The kept rows of a per-row tensor (`keep` None: every row); tensors with a broadcast batch of 1 (or None) pass
    through."""
    if tensor is None or keep is None or tensor.shape[0] == 1:
        return tensor
    return tensor[keep]


def true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the `count` True entries of `mask` [rows], ascending. The host knows `count`, so the device
    is not read (indexing by the mask would read it: a sync per call on a GPU)."""
    return torch.nonzero_static(mask, size=count)[:, 0]


def computed(state: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    return state() if callable(state) else state


def timed_rounds(calls: list[Callable[[], object]], device: torch.device, repeats: int = 5) -> list[list[float]]:
    """Wall-clock seconds of each call in each of `repeats` rounds after a warm-up round, synchronised on a GPU.
    Each round runs every call once, in reversed order every other round, so the machine's drift hits them alike."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be positive, got {repeats}.")
    seconds: list[list[float]] = [[] for _ in calls]
    for round_ in range(repeats + 1):
        for index in range(len(calls)) if round_ % 2 else reversed(range(len(calls))):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            calls[index]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:  # the first round warms up
                seconds[index].append(time.perf_counter() - start)
    return seconds


def random_state_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The caller's random state, restored on leaving: measuring a layer draws random inputs (and runs dropout in
    training), which must not move the samples of a seeded `generate` that measures on its first call."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


@dataclass(frozen=True)
class LayerCosts:
    """Measured seconds of one layer of a part, for one batch size and sequence shape, on one device and dtype.

    rows: the row counts measured, ascending (1, half the batch, the batch).
    kept: seconds of the layer over `rows[i]` rows of the batch forming one contiguous run (what `KeepPlan` runs).
    compacted: seconds over `rows[i]` scattered rows (every other row, the most runs: what `CompactPlan` may run).
    gather: seconds to gather the per-row tensors the loop carries, once per compaction.
    """

    rows: tuple[int, ...]
    kept: tuple[float, ...]
    compacted: tuple[float, ...]
    gather: float

    # Compaction must save at least this fraction of a layer. Rows that leave cost outside the layer too (their
    # keys and values filled by the KV strategy instead of computed, writes by index): at OFA-base size on a CPU,
    # decoding steps realized about 60% of the saving the layer timings predicted (2026-11-24, issue 21). The
    # margin also keeps timing noise (about 10% per layer timing there) from flipping the plan.
    margin = 0.4

    @staticmethod
    def interpolate(rows: tuple[int, ...], seconds: tuple[float, ...], count: int) -> float:
        """Seconds at `count` rows, linear between the measured row counts (clamped at the ends)."""
        right = min(max(bisect.bisect_left(rows, count), 1), len(rows) - 1)
        left = right - 1
        if len(rows) == 1:
            return seconds[0]
        share = (count - rows[left]) / (rows[right] - rows[left])
        return seconds[left] + min(max(share, 0.0), 1.0) * (seconds[right] - seconds[left])

    @classmethod
    @torch.no_grad()
    def measure(
        cls,
        batch_size: int,
        layer_on: Callable[[torch.Tensor], Callable[[], object]],
        gather: Callable[[], object],
        device: torch.device,
        scattered: bool = True,
    ) -> "LayerCosts":
        """Time `layer_on(rows)()` (one layer over the batch indices `rows`) at 1, half and all the rows, as one run
        and (`scattered`) spread over the batch, and `gather()`: medians of 5 interleaved rounds, synchronised."""
        rows = tuple(sorted({1, (batch_size + 1) // 2, batch_size}))
        calls = [layer_on(torch.arange(count, device=device)) for count in rows]
        if scattered:
            spread = [torch.linspace(0, batch_size - 1, count, device=device).round().long() for count in rows]
            calls += [layer_on(index) for index in spread]
        *layers, gathered = (statistics.median(rounds) for rounds in timed_rounds([*calls, gather], device))
        kept, compacted = tuple(layers[: len(rows)]), tuple(layers[len(rows) :] or layers[: len(rows)])
        return cls(rows, kept, compacted, gathered)

    def compact_pays(self, running: int, going_on: int) -> bool:
        """Whether the next layer on the `going_on` rows, gathered, costs less than on the `running` rows by the
        margin. One layer only: the rows that go on may stop at the next exit, and keeping is never slower than
        the step's deepest row, while a compaction that does not pay makes the step slower than that."""
        keep = self.interpolate(self.rows, self.kept, running)
        compact = self.gather + self.interpolate(self.rows, self.compacted, going_on)
        return compact < (1 - self.margin) * keep


class KeepPlan:
    """Ready rows stay in the batch and keep running: nothing to do at a stop."""

    def go_on(self, exits: "RowExits", layer: int, leaving: States, carried: tuple) -> tuple:
        return carried


class CompactPlan:
    """Ready rows leave the batch: the deeper layers run on the running rows only, and every per-row tensor the loop
    carries is gathered to them."""

    def go_on(self, exits: "RowExits", layer: int, leaving: States, carried: tuple) -> tuple:
        return exits.compact(layer, leaving, carried)


class AutoPlan:
    """Compact at a stop only when the layer costs predict that the next layer, gathered, saves `LayerCosts.margin`;
    keep otherwise. `costs()` is asked at every stop; the model measures them once per device, dtype and shape."""

    def __init__(self, costs: Callable[[], LayerCosts]):
        self.costs = costs

    def go_on(self, exits: "RowExits", layer: int, leaving: States, carried: tuple) -> tuple:
        if self.costs().compact_pays(len(exits.running), exits.waiting_count):
            return exits.compact(layer, leaving, carried)
        return carried


Plan = KeepPlan | CompactPlan | AutoPlan


class RowExits:
    """Which rows of one layer loop still run, which of them are ready, each row's exit layer, and the states each
    ready or departed row left with.

    exit_layers [batch]: the layer each row's output comes from (the loop's depth for rows never ready).
    layers_run [batch]: the layers each row ran (deeper than its exit layer when its plan kept it running);
    `layers_run_rows` holds it on the host.
    running [rows]: the batch indices of the rows the layers run on, ascending.
    waiting [rows]: which running rows are not ready yet.
    The host keeps `running` and `waiting` as lists too, from the one read of each stop decision, so that nothing
    else reads the device.
    active: `running` as `ActiveRows` for attention over the whole batch's cache; None while every row runs.
    """

    def __init__(
        self,
        batch_size: int,
        depth: int,
        device: torch.device,
        plan: Plan | None = None,
        token_from_batch_layer: bool = False,
        stop_fraction: float = 1.0,
        discarded: torch.Tensor | None = None,
    ):
        self.exit_layers = torch.full((batch_size,), depth, dtype=torch.long, device=device)
        self.layers_run = self.exit_layers.clone()
        self.depth = depth
        self.running = torch.arange(batch_size, device=device)
        self.waiting = torch.ones(batch_size, dtype=torch.bool, device=device)
        self.waiting_count = batch_size
        # On the host, from the first stop on: a loop where no row stops (the full model, which exports with a
        # dynamic batch size) never makes lists of its batch size.
        self.layers_run_rows: list[int] | None = None
        self._running_rows: list[int] | None = None
        self._waiting_rows: list[bool] | None = None
        self.active: ActiveRows | None = None
        self.plan = plan or CompactPlan()
        self.token_from_batch_layer = token_from_batch_layer
        self.stop_fraction = stop_fraction
        self.discarded = discarded  # [batch]: rows whose output `generate` throws away, outside the fraction
        self._discarded_count: int | None = None
        self.finished = False  # every row is ready
        self.stopped_together = False  # ... every row's output comes from the same layer, the last one run
        self._earlier_stops = False
        self._states: dict[str, torch.Tensor] = {}  # name -> [batch, ...], filled at the rows that kept one

    @property
    def waiting_running(self) -> torch.Tensor | None:
        """Which running rows wait [running rows], None while all of them do (no stopped row runs on)."""
        return None if self.waiting_count == len(self.running) else self.waiting

    def stop(self, layer: int, stop: torch.Tensor, ready: States, leaving: States, carried: tuple) -> tuple:
        """The waiting rows where `stop` [running rows] is True are ready after `layer` (1-based): they keep their
        `ready` states (name -> this layer's [running rows, ...] states, e.g. the exit head's input; a callable is
        computed only if a row stops), and their `leaving` states (e.g. the layer's output) when they leave the
        layers. Returns the per-row tensors in `carried` for the rows that run on; sets `finished` when none waits."""
        if self.waiting_count < len(self.running):
            stop = stop & self.waiting
        stops = stop.tolist()  # the one host read of a stop
        stopping = sum(stops)
        if stopping == 0:
            return carried
        batch = len(self.exit_layers)
        if self._running_rows is None:
            self.layers_run_rows, self._running_rows = [self.depth] * batch, list(range(batch))
            self._waiting_rows = [True] * batch  # no row stopped before
        if stopping < self.waiting_count and self.enough_ready(batch - self.waiting_count + stopping):
            stop, stops, stopping = self.waiting, self._waiting_rows, self.waiting_count  # the batch stops
        together = stopping == len(self.running)
        positions = None if together else true_positions(stop, stopping)
        rows = self.running if together else self.running[positions]
        self.exit_layers[self.index(rows)] = layer
        self.waiting_count -= stopping
        self._waiting_rows = [waits and not now for waits, now in zip(self._waiting_rows, stops, strict=True)]
        for name, state in ready.items():
            self.keep_state(name, computed(state) if together else computed(state)[positions], rows)
        if self.waiting_count == 0:
            self.finished = True
            self.stopped_together = len(self.running) == batch and (
                self.token_from_batch_layer or not self._earlier_stops
            )
            self.layers_run[self.index(self.running)] = layer
            for row in self._running_rows:
                self.layers_run_rows[row] = layer
            for name, state in leaving.items():
                self.keep_state(name, computed(state), self.running)
            return carried
        self._earlier_stops = True
        self.waiting = self.waiting & ~stop
        return self.plan.go_on(self, layer, leaving, carried)

    def index(self, rows: torch.Tensor) -> torch.Tensor | slice:
        """`rows` [rows] of the batch as an index; every row (always so at batch 1) as a slice: a fill, not a lookup."""
        return slice(None) if self.active is None and len(rows) == len(self.exit_layers) else rows

    def enough_ready(self, ready: int) -> bool:
        """Whether `ready` rows reach the stop fraction of the rows whose output counts. The discarded rows are among
        the ready ones from the first exit on (they stop there), and count on neither side."""
        if self.stop_fraction >= 1:
            return False
        batch = len(self.exit_layers)
        if self._discarded_count is None:  # read once per step, at the first stop that asks
            self._discarded_count = 0 if self.discarded is None else int(self.discarded.sum())
        discarded = self._discarded_count
        return ready - discarded >= self.stop_fraction * (batch - discarded)

    def compact(self, layer: int, leaving: States, carried: tuple) -> tuple:
        """The ready rows leave the layers after `layer` with their `leaving` states; returns `carried` for the rest."""
        kept = true_positions(self.waiting, self.waiting_count)
        left = true_positions(~self.waiting, len(self.running) - self.waiting_count)
        gone = self.running[left]
        self.layers_run[gone] = layer
        for row, waits in zip(self._running_rows, self._waiting_rows, strict=True):
            if not waits:
                self.layers_run_rows[row] = layer
        for name, state in leaving.items():
            self.keep_state(name, computed(state)[left], gone)
        self.running = self.running[kept]
        self.waiting = self.waiting.new_ones(self.waiting_count)
        self._running_rows = [row for row, waits in zip(self._running_rows, self._waiting_rows, strict=True) if waits]
        self._waiting_rows = [True] * self.waiting_count
        self.active = ActiveRows.of(self.running, self._running_rows)
        return tuple(select_rows(tensor, kept) for tensor in carried)

    def keep_state(self, name: str, state: torch.Tensor, rows: torch.Tensor) -> None:
        if name not in self._states and len(rows) == len(self.exit_layers):  # the whole batch at once: no copy
            self._states[name] = state
            return
        if name not in self._states:
            self._states[name] = state.new_empty((len(self.exit_layers), *state.shape[1:]))
        self._states[name][rows] = state

    def stopped_state(self, name: str) -> torch.Tensor | None:
        """[batch, ...]: the `name` state of each row that kept one (other rows unset); None if no row did."""
        return self._states.get(name)

    def snapshot(self, name: str, running_state: torch.Tensor) -> torch.Tensor:
        """[batch, ...] at the current layer, for layer outputs (`output_hidden_states`): each ready row's kept `name`
        state, the waiting rows' `running_state` [running rows, ...]. A copy: the kept states change later."""
        kept = self._states.get(name)
        if kept is None:  # no row is ready yet: every row runs
            return running_state
        return self.with_waiting_rows(kept.clone(), running_state)

    def spread(self, running_state: torch.Tensor | None) -> torch.Tensor | None:
        """[running rows, ...] -> [batch, ...] (`output_attentions`): zeros for the rows that stopped before this
        layer, whether they left the layers or run on with the batch (`keep`), so that every plan shows the same."""
        if running_state is None or self.waiting_count == len(self.exit_layers):
            return running_state
        return self.with_waiting_rows(
            running_state.new_zeros((len(self.exit_layers), *running_state.shape[1:])), running_state
        )

    def gather(self, name: str, running_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's final `name` state [batch, ...] and the layer it comes from [batch]: the state it kept at its
        exit, or `running_state` [running rows, ...] (the state of the last layer run) for the rows still waiting,
        and for every running row when their output comes from the layer where the batch stopped (then the layer
        is that one, not their exit)."""
        stopped = self._states.get(name)
        if self.token_from_batch_layer:
            exit_layers = self.exit_layers.clone()
            exit_layers[self.running] = self.layers_run[self.running]
            if stopped is None or len(self.running) == len(self.exit_layers):
                return running_state, exit_layers
            stopped[self.running] = running_state
            return stopped, exit_layers
        if stopped is None:
            return running_state, self.exit_layers
        return self.with_waiting_rows(stopped, running_state) if self.waiting_count else stopped, self.exit_layers

    def with_waiting_rows(self, state: torch.Tensor, running_state: torch.Tensor) -> torch.Tensor:
        """`state` [batch, ...] with the rows still waiting set to theirs in `running_state` [running rows, ...]."""
        waiting = true_positions(self.waiting, self.waiting_count)
        state[self.running[waiting]] = running_state[waiting]
        return state


__all__ = [
    "ActiveRows",
    "AutoPlan",
    "CompactPlan",
    "KeepPlan",
    "LayerCosts",
    "RowExits",
    "timed_rounds",
    "random_state_kept",
    "select_rows",
    "true_positions",
]
