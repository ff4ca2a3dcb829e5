import torch

from hf_earlyexit.modeling.row_exits import ActiveRows, AutoPlan, KeepPlan, LayerCosts, RowExits

CPU = torch.device("cpu")


def states(rows: int, value: float) -> torch.Tensor:
    return torch.full((rows, 2), value)


def test_rows_that_stop_leave_with_their_state_and_the_rest_go_on():
    exits = RowExits(batch_size=4, depth=3, device=CPU)
    hidden, shared = states(4, 1.0), torch.zeros(1, 5)  # a per-row tensor and a broadcast one
    hidden, shared = exits.stop(1, torch.tensor([False, True, False, True]), {"output": hidden}, {}, (hidden, shared))
    assert exits.running.tolist() == [0, 2] and exits.active.runs == [(0, 1), (2, 3)]
    assert hidden.shape == (2, 2) and shared.shape == (1, 5)  # broadcast tensors pass through
    hidden = states(2, 2.0)
    hidden, shared = exits.stop(2, torch.tensor([False, False]), {"output": lambda: 1 / 0}, {}, (hidden, shared))
    assert not exits.finished  # nobody stopped, so the state was never computed
    final, exit_layers = exits.gather("output", states(2, 3.0))
    assert exit_layers.tolist() == [3, 1, 3, 1] and exits.layers_run.tolist() == [3, 1, 3, 1]
    assert final[:, 0].tolist() == [3.0, 1.0, 3.0, 1.0]
    assert not exits.stopped_together


def test_a_batch_that_stops_at_once_keeps_its_states_without_a_copy():
    exits = RowExits(batch_size=3, depth=4, device=CPU)
    hidden = states(3, 7.0)
    exits.stop(2, torch.ones(3, dtype=torch.bool), {"output": hidden}, {}, (hidden,))
    assert exits.finished and exits.stopped_together
    final, exit_layers = exits.gather("output", hidden)
    assert final is hidden and exit_layers.tolist() == [2, 2, 2]


def test_the_last_rows_to_stop_finish_the_loop_with_the_earlier_ones_states():
    exits = RowExits(batch_size=3, depth=4, device=CPU)
    (hidden,) = exits.stop(1, torch.tensor([True, False, False]), {"output": states(3, 1.0)}, {}, (states(3, 1.0),))
    exits.stop(2, torch.tensor([True, True]), {"output": states(2, 2.0)}, {}, (hidden,))
    assert exits.finished and not exits.stopped_together
    final, exit_layers = exits.gather("output", states(2, 9.0))
    assert final[:, 0].tolist() == [1.0, 2.0, 2.0] and exit_layers.tolist() == [1, 2, 2]
    assert exits.stopped_state("output") is not None


def test_kept_rows_run_on_with_the_batch_and_keep_the_state_they_were_ready_with():
    exits = RowExits(batch_size=3, depth=4, device=CPU, plan=KeepPlan())
    hidden = states(3, 1.0)
    (carried,) = exits.stop(1, torch.tensor([True, False, False]), {"token": hidden}, {"output": hidden}, (hidden,))
    assert carried is hidden and exits.running.tolist() == [0, 1, 2] and exits.active is None
    # Row 0 is asked again and says "stop" again: it is already ready, so nothing changes for it.
    exits.stop(2, torch.tensor([True, False, False]), {"token": lambda: 1 / 0}, {"output": hidden}, (hidden,))
    exits.stop(3, torch.tensor([False, True, True]), {"token": states(3, 3.0)}, {"output": states(3, 30.0)}, (hidden,))
    assert exits.finished and not exits.stopped_together
    assert exits.exit_layers.tolist() == [1, 3, 3] and exits.layers_run.tolist() == [3, 3, 3]
    assert exits.gather("token", states(3, 9.0))[0][:, 0].tolist() == [1.0, 3.0, 3.0]
    assert exits.stopped_state("output")[:, 0].tolist() == [30.0, 30.0, 30.0]  # left at layer 3, all of them


def test_tokens_from_the_batch_layer_take_the_last_layer_the_batch_ran():
    exits = RowExits(batch_size=3, depth=4, device=CPU, plan=KeepPlan(), token_from_batch_layer=True)
    hidden = states(3, 1.0)
    exits.stop(1, torch.tensor([True, False, False]), {"token": hidden}, {}, (hidden,))
    exits.stop(2, torch.tensor([False, True, False]), {"token": states(3, 2.0)}, {}, (hidden,))
    assert not exits.finished
    final, exit_layers = exits.gather("token", states(3, 4.0))
    assert final[:, 0].tolist() == [4.0, 4.0, 4.0] and exit_layers.tolist() == [4, 4, 4]  # the batch ran to depth 4
    assert exits.exit_layers.tolist() == [1, 2, 4]  # where each row was ready: the result is returned, not written


def test_the_batch_stops_once_the_fraction_of_ready_rows_is_reached():
    exits = RowExits(batch_size=4, depth=6, device=CPU, plan=KeepPlan(), stop_fraction=0.5)
    hidden = states(4, 1.0)
    exits.stop(1, torch.tensor([True, False, False, False]), {"token": hidden}, {}, (hidden,))
    assert not exits.finished  # 1 of 4 ready
    exits.stop(2, torch.tensor([False, True, False, False]), {"token": states(4, 2.0)}, {}, (hidden,))
    assert exits.finished and exits.exit_layers.tolist() == [1, 2, 2, 2]


def test_finished_rows_are_counted_once_per_step_and_stand_outside_the_fraction():
    """Finished rows (`discarded`) stop at the first exit and count on neither side of the fraction; their count is
    read from the device at the first stop that asks, not at every stop (a sync on a GPU)."""
    sums = []

    class Discarded(torch.Tensor):
        def sum(self, *args, **kwargs):
            sums.append(1)
            return super().sum(*args, **kwargs)

    discarded = torch.tensor([True, True, False, False, False, False]).as_subclass(Discarded)
    exits = RowExits(batch_size=6, depth=6, device=CPU, plan=KeepPlan(), stop_fraction=0.5, discarded=discarded)
    hidden = states(6, 1.0)
    exits.stop(1, torch.tensor([True, True, False, False, False, False]), {"token": hidden}, {}, (hidden,))
    exits.stop(2, torch.tensor([False, False, True, False, False, False]), {"token": hidden}, {}, (hidden,))
    assert not exits.finished  # 1 of the 4 rows that count
    exits.stop(3, torch.tensor([False, False, False, True, False, False]), {"token": hidden}, {}, (hidden,))
    assert exits.finished and exits.exit_layers.tolist() == [1, 1, 2, 3, 3, 3] and len(sums) == 1


def costs(kept: float, compacted: float, gather: float = 0.0) -> LayerCosts:
    return LayerCosts(rows=(1, 2, 4), kept=(kept,) * 3, compacted=(compacted, compacted, kept), gather=gather)


def test_auto_compacts_only_where_the_measured_costs_say_it_pays():
    assert costs(kept=10.0, compacted=5.0).compact_pays(running=4, going_on=2)
    assert not costs(kept=10.0, compacted=5.0, gather=3.0).compact_pays(running=4, going_on=2)  # within one layer
    assert not costs(kept=10.0, compacted=7.0).compact_pays(running=4, going_on=2)  # within the margin
    for pays, running in ((costs(kept=10.0, compacted=1.0), [2, 3]), (costs(kept=1.0, compacted=10.0), [0, 1, 2, 3])):
        exits = RowExits(batch_size=4, depth=4, device=CPU, plan=AutoPlan(lambda pays=pays: pays))
        hidden = states(4, 1.0)
        exits.stop(1, torch.tensor([True, True, False, False]), {"token": hidden}, {"output": hidden}, (hidden,))
        assert exits.running.tolist() == running


def test_layer_costs_interpolate_between_the_measured_rows():
    table = LayerCosts(rows=(1, 3, 5), kept=(1.0, 3.0, 4.0), compacted=(1.0, 3.0, 4.0), gather=0.0)
    assert [table.interpolate(table.rows, table.kept, rows) for rows in (1, 2, 4, 5, 8)] == [1.0, 2.0, 3.5, 4.0, 4.0]


def test_layer_costs_are_measured_for_each_row_count():
    calls = []
    measured = LayerCosts.measure(4, lambda rows: lambda: calls.append(rows.tolist()), lambda: None, CPU)
    assert measured.rows == (1, 2, 4) and len(measured.kept) == len(measured.compacted) == 3
    assert [0, 3] in calls and [0, 1] in calls  # scattered and contiguous halves of the batch
    assert len(calls) == 6 * 6  # every row count both ways, a warm-up round and 5 timed rounds
    unscattered = LayerCosts.measure(4, lambda rows: lambda: None, lambda: None, CPU, scattered=False)
    assert unscattered.compacted == unscattered.kept


def test_active_rows_group_contiguous_runs():
    assert ActiveRows.of(torch.tensor([0, 1, 2, 5, 7, 8])).runs == [(0, 3), (5, 6), (7, 9)]
