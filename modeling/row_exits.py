"""The one row-exit mechanism of every layer loop (joint encoder, each encoder stream, decoder step).

A layer loop asks its controller after a layer "which running rows stop here?" and hands the answer to `RowExits`,
which records each stopping row's exit layer and the states it leaves with (its exit state), and gives the loop what
goes on. What happens to the rows that stop is the execution plan:

- `CompactPlan` (today's only plan): they leave the batch, and the deeper layers run on the running rows only,
  gathered. Attention then reads each contiguous run of the batch's cached K/V as a view (`ActiveRows`).

A plan is an object, so a second one (rows kept in the batch, when a layer costs the same for any number of rows)
plugs in without touching the loops. Nothing here imports the model.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ActiveRows:
    """The rows of the batch a layer runs on: their indices, and the contiguous runs they form so that attention
    reads each run's cached K/V as a view instead of gathering them (at batch > 1 the cross-attention K/V are as
    large as a layer's weights; copying them would eat the time the exit saves)."""

    index: torch.Tensor  # [rows], ascending
    runs: list[tuple[int, int]]  # [start, end) in the batch

    @classmethod
    def of(cls, index: torch.Tensor) -> "ActiveRows":
        runs: list[list[int]] = []
        for row in index.tolist():
            if runs and runs[-1][1] == row:
                runs[-1][1] += 1
            else:
                runs.append([row, row + 1])
        return cls(index, [(start, end) for start, end in runs])


def select_rows(tensor: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor | None:
    """The kept rows of a per-row tensor; tensors with a broadcast batch of 1 (or None) pass through."""
    if tensor is None or tensor.shape[0] == 1:
        return tensor
    return tensor[keep]


def computed(state: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    return state() if callable(state) else state


class CompactPlan:
    """Rows that stop leave the batch: the deeper layers run on the running rows only, and every per-row tensor the
    loop carries is gathered to them."""

    name = "compact"

    def go_on(
        self, exits: "RowExits", keep: torch.Tensor, carried: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, ...]:
        """The rows where `keep` [rows] is True go on: `exits` runs them only; returns `carried` for them."""
        exits.running = exits.running[keep]
        exits.active = ActiveRows.of(exits.running)
        return tuple(select_rows(tensor, keep) for tensor in carried)


class RowExits:
    """Which rows of one layer loop still run, each row's exit layer, and the states each stopped row left with.

    exit_layers [batch]: the layers each row ran (the loop's depth for rows that never stopped).
    running [rows]: the batch indices of the rows still running, ascending.
    active: the same as `ActiveRows` for attention over the whole batch's cache; None while every row runs.
    """

    def __init__(self, batch_size: int, depth: int, device: torch.device, plan: CompactPlan | None = None):
        self.exit_layers = torch.full((batch_size,), depth, dtype=torch.long, device=device)
        self.running = torch.arange(batch_size, device=device)
        self.active: ActiveRows | None = None
        self.plan = plan or CompactPlan()
        self.finished = False  # every row has stopped
        self.stopped_together = False  # ... and all of them after the same layer
        self._states: dict[str, torch.Tensor] = {}  # name -> [batch, ...], filled at the rows that stopped

    def stop(
        self,
        layer: int,
        stop: torch.Tensor,
        states: dict[str, torch.Tensor | Callable[[], torch.Tensor]],
        carried: tuple[torch.Tensor | None, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        """The running rows where `stop` [rows] is True leave after `layer` (1-based), with `states` (name -> this
        layer's [rows, ...] states, e.g. its output; a callable is computed only if a row stops). Returns the per-row
        tensors in `carried` for the rows that go on (unchanged when none stops); sets `finished` when none goes on."""
        stopping = sum(stop.tolist())  # one host read, cheaper than a sum op on a few rows
        if stopping == 0:
            return carried
        self.exit_layers[self.running[stop]] = layer
        if stopping == len(self.running):
            self.finished = True
            self.stopped_together = not self._states
            for name, state in states.items():
                self.keep_state(name, computed(state), self.running)
            return carried
        for name, state in states.items():
            self.keep_state(name, computed(state)[stop], self.running[stop])
        return self.plan.go_on(self, ~stop, carried)

    def keep_state(self, name: str, state: torch.Tensor, rows: torch.Tensor) -> None:
        if name not in self._states and len(rows) == len(self.exit_layers):  # the whole batch at once: no copy
            self._states[name] = state
            return
        if name not in self._states:
            self._states[name] = state.new_empty((len(self.exit_layers), *state.shape[1:]))
        self._states[name][rows] = state

    def stopped_state(self, name: str) -> torch.Tensor | None:
        """[batch, ...]: the `name` state of each row that stopped (other rows unset); None if no row stopped."""
        return self._states.get(name)

    def gather(self, name: str, running_state: torch.Tensor) -> torch.Tensor:
        """Each row's final state [batch, ...]: the `name` state it stopped with, or `running_state` [running rows,
        ...] for the rows that ran to the end."""
        stopped = self._states.get(name)
        if stopped is None:
            return running_state
        if not self.finished:
            stopped[self.running] = running_state
        return stopped


__all__ = ["ActiveRows", "CompactPlan", "RowExits", "select_rows"]
