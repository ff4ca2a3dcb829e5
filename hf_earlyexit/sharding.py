"""Runs split over the processes of `accelerate launch` (one model per process, on the device Accelerate gives it):
each process decodes a contiguous share of the batches, and every process gets the whole run back, in order, so
whatever is computed from it (scores, losses, a calibration's choice) is the same on every process and the same as
in one process. Without `accelerate launch` there is one process and nothing is split.
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

T = TypeVar("T")


def process_state() -> PartialState:
    """Accelerate's state of this process; without a GPU its processes run on the CPU (gloo), which Accelerate only
    sets up when asked."""
    return PartialState(cpu=not torch.cuda.is_available())


def is_main_process() -> bool:
    """Whether this process prints, draws progress bars and writes files."""
    return process_state().is_main_process


def process_device() -> torch.device:
    """The device Accelerate gives this process (the CPU without GPUs)."""
    return process_state().device


def shared_map(function: Callable[[T], object], items: Sequence[T], progress: str | None = None) -> list:
    """`[function(item) for item in items]`, each process mapping a contiguous share; every process gets the whole
    list, in order. `progress`: the description of a bar over the main process's share (None: no bar)."""
    from tqdm.auto import tqdm

    state = process_state()
    with state.split_between_processes(list(range(len(items)))) as mine:
        shown = tqdm(mine, desc=progress, disable=progress is None or not state.is_main_process)
        results = [function(items[index]) for index in shown]
    return gather_object(results) if state.num_processes > 1 else results


def from_main_process(make: Callable[[], T]) -> T:
    """`make()` on the main process, sent to the others (a timing, which processes measuring at once would skew)."""
    state = process_state()
    if state.num_processes == 1:
        return make()
    value = [make() if state.is_main_process else None]
    broadcast_object_list(value)
    return value[0]


__all__ = ["from_main_process", "is_main_process", "process_device", "process_state", "shared_map"]
