import torch

from hf_earlyexit.modeling.row_exits import ActiveRows, RowExits


def states(rows: int, value: float) -> torch.Tensor:
    return torch.full((rows, 2), value)


def test_rows_that_stop_leave_with_their_state_and_the_rest_go_on():
    exits = RowExits(batch_size=4, depth=3, device=torch.device("cpu"))
    hidden, shared = states(4, 1.0), torch.zeros(1, 5)  # a per-row tensor and a broadcast one
    hidden, shared = exits.stop(1, torch.tensor([False, True, False, True]), {"output": hidden}, (hidden, shared))
    assert exits.running.tolist() == [0, 2] and exits.active.runs == [(0, 1), (2, 3)]
    assert hidden.shape == (2, 2) and shared.shape == (1, 5)  # broadcast tensors pass through
    hidden = states(2, 2.0)
    hidden, shared = exits.stop(2, torch.tensor([False, False]), {"output": lambda: 1 / 0}, (hidden, shared))
    assert not exits.finished  # nobody stopped, so the state was never computed
    final = exits.gather("output", states(2, 3.0))
    assert exits.exit_layers.tolist() == [3, 1, 3, 1]
    assert final[:, 0].tolist() == [3.0, 1.0, 3.0, 1.0]
    assert not exits.stopped_together


def test_a_batch_that_stops_at_once_keeps_its_states_without_a_copy():
    exits = RowExits(batch_size=3, depth=4, device=torch.device("cpu"))
    hidden = states(3, 7.0)
    exits.stop(2, torch.ones(3, dtype=torch.bool), {"output": hidden}, (hidden,))
    assert exits.finished and exits.stopped_together
    assert exits.gather("output", hidden) is hidden and exits.exit_layers.tolist() == [2, 2, 2]


def test_the_last_rows_to_stop_finish_the_loop_with_the_earlier_ones_states():
    exits = RowExits(batch_size=3, depth=4, device=torch.device("cpu"))
    (hidden,) = exits.stop(1, torch.tensor([True, False, False]), {"output": states(3, 1.0)}, (states(3, 1.0),))
    exits.stop(2, torch.tensor([True, True]), {"output": states(2, 2.0)}, (hidden,))
    assert exits.finished and not exits.stopped_together
    assert exits.gather("output", states(2, 9.0))[:, 0].tolist() == [1.0, 2.0, 2.0]
    assert exits.stopped_state("output") is not None and exits.exit_layers.tolist() == [1, 2, 2]


def test_active_rows_group_contiguous_runs():
    assert ActiveRows.of(torch.tensor([0, 1, 2, 5, 7, 8])).runs == [(0, 3), (5, 6), (7, 9)]
