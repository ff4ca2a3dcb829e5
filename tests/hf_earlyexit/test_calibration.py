"""Calibration on synthetic score tables: the frontier, the tolerance rule, Learn then Test, saved defaults."""

import json
import random

import pytest
import torch

from hf_earlyexit.calibration import (
    OperatingPoint,
    calibrate,
    calibration_grid,
    fastest_for_every_task,
    fastest_within_tolerance,
    learn_then_test,
    pareto_frontier,
    save_calibration,
    with_encoder_min_exit_layer,
    write_generation_defaults,
)
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit
from tests.helpers import tiny_inputs, tiny_model
from tests.hf_earlyexit.test_evaluation import task_setup

# threshold -> (quality, expected time reduction): lower thresholds exit earlier, lose quality
TABLE = {1.0: (0.800, 0.00), 0.95: (0.800, 0.20), 0.9: (0.796, 0.35), 0.85: (0.790, 0.45), 0.8: (0.700, 0.60),
         0.75: (0.780, 0.30)}  # fmt: skip


def points() -> list[OperatingPoint]:
    return [OperatingPoint({"exit_threshold": t}, q, r) for t, (q, r) in TABLE.items()]


def test_frontier_keeps_exactly_the_undominated_points():
    frontier = pareto_frontier(points())
    assert [p.settings["exit_threshold"] for p in frontier] == [0.8, 0.85, 0.9, 0.95]  # 0.75 and 1.0 are dominated


def test_fastest_within_tolerance_of_the_full_model():
    assert fastest_within_tolerance(points(), 0.800, 0.02).settings == {"exit_threshold": 0.85}  # 0.790 >= 0.784
    assert fastest_within_tolerance(points(), 0.800, 0.01).settings == {"exit_threshold": 0.9}  # 0.790 < 0.792
    assert fastest_within_tolerance(points(), 0.800, 0.0).settings == {"exit_threshold": 0.95}
    assert fastest_within_tolerance(points(), 0.900, 0.01) is None
    exact = [OperatingPoint({"exit_threshold": 0.5}, 38 / 53, 0.1)]  # 0.95 x 40/53, which float rounding missed
    assert fastest_within_tolerance(exact, 40 / 53, 0.05) is exact[0]
    with pytest.raises(ValueError, match="tolerance"):
        fastest_within_tolerance(points(), 0.8, 1.5)


def test_learn_then_test_walks_the_ordering_splits_order_and_stops_at_the_first_failure():
    rng = random.Random(0)

    def point(reduction: float, disagreement: float) -> OperatingPoint:
        losses = [float(rng.random() < disagreement) for _ in range(2000)]
        return OperatingPoint({"exit_threshold": 1 - reduction}, 0.8, reduction, sample_losses=losses)

    table = [point(0.1, 0.0), point(0.2, 0.01), point(0.3, 0.03), point(0.4, 0.12), point(0.5, 0.02)]
    ordering = [OperatingPoint(p.settings, 0.8, p.expected_time_reduction) for p in table]
    certified = learn_then_test(table, ordering, risk_level=0.06, delta=0.1)
    assert [p.expected_time_reduction for p, _ in certified] == [0.1, 0.2, 0.3]  # 0.4 fails: 0.5 is never tested
    assert all(0 <= value <= 0.1 for _, value in certified)
    # The order is the ordering split's, not the tested samples': there, 0.5 comes before the failing 0.4.
    ordering[4].expected_time_reduction = 0.35
    assert [p.expected_time_reduction for p, _ in learn_then_test(table, ordering, 0.06, 0.1)][-1] == 0.5
    assert learn_then_test([point(0.1, 0.5)], ordering, risk_level=0.06) == []
    with pytest.raises(ValueError, match="per-sample losses"):
        learn_then_test([OperatingPoint({}, 0.8, 0.1)], [OperatingPoint({}, 0.8, 0.1)])
    with pytest.raises(ValueError, match="no point for the setting"):
        learn_then_test(table, ordering[:2])
    with pytest.raises(ValueError, match="0 or 1"):
        learn_then_test([OperatingPoint({}, 0.8, 0.1, sample_losses=[0.5])], [OperatingPoint({}, 0.8, 0.1)])


def test_generation_defaults_round_trip_and_make_generate_exit(tmp_path):
    model = tiny_model(decoder_layers=4)
    write_generation_defaults(model, {"exit_threshold": 0.5, "kv_strategy": "copy"})
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert (reloaded.generation_config.exit_threshold, reloaded.generation_config.kv_strategy) == (0.5, "copy")
    out = reloaded.generate(**tiny_inputs(), max_new_tokens=6, return_dict_in_generate=True)
    asked = model.generate(**tiny_inputs(), max_new_tokens=6, return_dict_in_generate=True, exit_threshold=0.5)
    assert torch.equal(out.exit_layers, asked.exit_layers) and bool((out.exit_layers < 4).any())
    for bad, message in (({"exit_treshold": 0.5}, "Unknown"), ({"exit_threshold": 2.0}, "exit_threshold"),
                         ({"exit_controller": object()}, "scalar")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            write_generation_defaults(model, bad)
    write_generation_defaults(model, {"exit_policy": "confidence", "min_exit_layer": 3})
    for bad, message in (({"exit_threshold": -0.5}, r"\[0.0, 1.0\]"), ({"max_exit_layer": 2}, "max_exit_layer")):
        with pytest.raises(ValueError, match=message):  # valid alone, not beside the saved defaults `generate` reads
            write_generation_defaults(model, bad)
    assert model.generation_config.exit_threshold == 0.5 and not hasattr(model.generation_config, "max_exit_layer")


def test_risk_levels_that_are_no_numbers_are_named():
    from hf_earlyexit.calibration import risk_levels

    for risk, message in (({"vqa": "0.1"}, "got '0.1'"), ({"vqa": None}, "got None"), (True, "got True")):
        with pytest.raises(ValueError, match=f"The risk level must lie in \\(0, 1\\), {message}"):
            risk_levels(risk, ["vqa"])


def test_one_setting_for_every_task_is_the_fastest_within_tolerance_on_all():
    vqa = (OperatingPoint({}, 0.80, 0.0), points())
    # On captions 0.85 loses 5% and 0.9 only 0.5%: 0.9 is the fastest setting within 1% on both tasks.
    captions = [OperatingPoint({"exit_threshold": t}, q, r) for t, q, r in ((0.85, 0.95, 0.5), (0.9, 0.995, 0.4))]
    chosen = fastest_for_every_task({"vqa": vqa, "caption": (OperatingPoint({}, 1.0, 0.0), captions)}, 0.01)
    assert chosen == {"exit_threshold": 0.9}
    assert fastest_for_every_task({"vqa": vqa}, 0.01) == fastest_within_tolerance(vqa[1], 0.80, 0.01).settings
    assert fastest_for_every_task({"caption": (OperatingPoint({}, 1.0, 0.0), captions[:1])}, 0.01) is None
    # A user's controller in a setting: told apart from the others by its repr.
    fixed = [
        OperatingPoint({"exit_controller": FixedLayerExit(k)}, q, r) for k, q, r in ((1, 0.99, 0.6), (2, 1.0, 0.3))
    ]
    chosen = fastest_for_every_task({"vqa": (OperatingPoint({}, 1.0, 0.0), fixed)}, 0.01)
    assert chosen == fixed[0].settings


def test_the_encoder_min_exit_layer_is_the_shallowest_exit_on_any_task():
    settings = {"exit_threshold": 0.9, "encoder_text_exit_threshold": 0.95}
    swept = [OperatingPoint(settings, 0.8, 0.3, shallowest_encoder_exit=3), OperatingPoint(settings, 0.9, 0.2, None)]
    with pytest.raises(ValueError, match="shallowest encoder exit"):
        with_encoder_min_exit_layer(settings, swept)
    swept[1].shallowest_encoder_exit = 2
    assert with_encoder_min_exit_layer(settings, swept) == {**settings, "encoder_min_exit_layer": 2}
    assert with_encoder_min_exit_layer({"exit_threshold": 0.9}, swept) == {"exit_threshold": 0.9}  # no encoder exit


def test_grid_covers_each_decoder_policy_and_encoder_stream():
    decomposed = tiny_model(decompose_encoder_modalities=True).config
    grid = calibration_grid(decomposed, {"similarity": (0.9,), "confidence": (0.5, 0.8)}, (0.95,))
    assert len(grid) == 4 * 2 * 2 - 1 and {} not in grid  # (none + 3 decoder) x (none + 1) per stream, minus full
    assert {"exit_policy": "confidence", "exit_threshold": 0.8, "encoder_text_exit_threshold": 0.95} in grid
    joint = calibration_grid(tiny_model().config, {"similarity": (0.9,)}, (0.95,))
    assert {"encoder_exit_threshold": 0.95} in joint and len(joint) == 2 * 2 - 1


def test_calibrate_returns_the_report_and_writes_the_choice(tmp_path):
    model, processor, _ = task_setup("vqa", samples=4)
    drawn = []

    def plot(sweeps, chosen):
        drawn.append((set(sweeps), chosen))
        return tmp_path / "tradeoff.png"

    report = calibrate(
        model, processor, ["vqa"], samples=4, batch_size=4, tolerance=0.99, decoder_thresholds={"confidence": (0.0,)},
        encoder_thresholds=(-1.0,), plot=plot, write_to=tmp_path, progress=False,
    )  # fmt: skip
    assert report["split"] == "validation" and report["points"] == 2 * 2 * 2 - 1 and list(report["tasks"]) == ["vqa"]
    assert report["device"].startswith("cpu (") and report["dtype"] == "float32"  # the clock the choice was priced by
    task = report["tasks"]["vqa"]
    # The part costs are timed, so which setting is fastest depends on the machine: only its shape is checked.
    assert task["pareto_frontier"] and 0 <= task["chosen"]["expected_time_reduction"] < 1
    assert drawn == [
        ({"vqa"}, {key: value for key, value in report["chosen"].items() if key != "encoder_min_exit_layer"})
    ]
    assert report["plot"] == str(tmp_path / "tradeoff.png")
    assert report["written_to"] == str(tmp_path / "generation_config.json")
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert all(saved[name] == value for name, value in report["chosen"].items())
    record = json.loads((tmp_path / "calibration.json").read_text())
    assert record["chosen"] == report["chosen"] and record["device"] == report["device"]


def test_calibrate_with_a_risk_orders_on_a_tenth_and_certifies_on_the_rest(tmp_path):
    model, processor, _ = task_setup("vqa", samples=8)
    # Threshold 1.0 never exits (no answer differs); 0.0 exits every token after layer 1.
    sweep = dict(samples=8, batch_size=2, decoder_thresholds={"confidence": (1.0, 0.0)}, encoder_thresholds=())
    report = calibrate(model, processor, ["vqa"], **sweep, risk=0.5, delta=0.2, progress=False)
    certificate = report["tasks"]["vqa"]["certificate"]
    assert (certificate["ordering_samples"], certificate["tested_samples"]) == (2, 6)  # a tenth, two at least
    # Threshold 1.0 is certified (no answer differs in 6) and 0.0 is not, where the sequence stops; 1.0 exits nowhere,
    # so it pays its tests for nothing and is not chosen (it was, and `--write` saved it).
    assert certificate["certified_settings"] == 1
    assert certificate["stopped_at"]["empirical_risk"] == pytest.approx(5 / 6)
    assert report["chosen"] is None

    wide = calibrate(model, processor, ["vqa"], **{**sweep, "batch_size": 16}, risk=0.5, delta=0.2, progress=False)
    assert wide["tasks"]["vqa"]["certificate"] == certificate  # a batch wider than the samples splits the same

    report = calibrate(model, processor, ["vqa"], **sweep, risk=0.01, delta=0.2, progress=False)  # 6 cannot certify
    stopped = report["tasks"]["vqa"]["certificate"]["stopped_at"]
    assert report["chosen"] is None and report["tasks"]["vqa"]["certificate"]["certified_settings"] == 0
    assert stopped["settings"] == {"exit_policy": "confidence", "exit_threshold": 1.0}
    assert stopped["samples_needed"] == 161  # 0.99^n <= 0.2
    with pytest.raises(ValueError, match=r"No setting is certified .*vqa 1.0%.* \{'vqa': 161\}: nothing written"):
        save_calibration(model, report, tmp_path)
    with pytest.raises(ValueError, match="3 samples are too few"):  # two to order, one left to test
        calibrate(model, processor, ["vqa"], **{**sweep, "samples": 3}, risk=0.5, progress=False)


def test_writing_a_choice_resets_the_lossy_knobs_it_does_not_set(tmp_path):
    """The grid runs each setting on top of no exit: an earlier calibration's encoder exits or `max_exit_layer` must
    not stay beside a choice that was measured without them. Speculative mode's own saved knobs stay."""
    model = tiny_model(decoder_layers=4)
    earlier = {
        "encoder_exit_threshold": 0.9,
        "max_exit_layer": 2,
        "exit_mode": "speculative",
        "draft_exit_threshold": 0.4,
    }
    for name, value in earlier.items():
        setattr(model.generation_config, name, value)
    chosen = {"exit_policy": "confidence", "exit_threshold": 0.5}
    save_calibration(model, {"chosen": chosen, "tolerance": 0.01}, tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["exit_policy"] == "confidence" and saved["exit_threshold"] == 0.5
    assert saved["encoder_exit_threshold"] is None and saved["max_exit_layer"] is None
    assert saved["exit_mode"] == "speculative" and saved["draft_exit_threshold"] == 0.4


def test_a_write_that_fails_leaves_the_folder_as_it_was(tmp_path):
    """The defaults and the record of how they were chosen go in together or not at all."""
    model = tiny_model()
    model.generation_config.save_pretrained(tmp_path)
    before = (tmp_path / "generation_config.json").read_text()
    (tmp_path / "calibration.json").mkdir()  # a record that cannot be replaced
    with pytest.raises(OSError):
        save_calibration(
            model, {"chosen": {"exit_policy": "confidence", "exit_threshold": 0.5}, "tolerance": 0.01}, tmp_path
        )
    assert (tmp_path / "generation_config.json").read_text() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["calibration.json", "generation_config.json"]


def test_a_file_that_cannot_be_replaced_after_another_was_puts_the_other_back(tmp_path, monkeypatch):
    """`calibration.json` was replaced, then `generation_config.json` could not be: a record of defaults never
    written."""
    from pathlib import Path

    model = tiny_model()
    model.generation_config.save_pretrained(tmp_path)
    (tmp_path / "calibration.json").write_text('{"chosen": "before"}')
    before = {path.name: path.read_text() for path in tmp_path.iterdir()}
    replace = Path.replace

    def immutable_defaults(self, target):  # the new defaults cannot take the old ones' place
        if self.name == "generation_config.json" and Path(target) == tmp_path / "generation_config.json":
            raise PermissionError("Operation not permitted")
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", immutable_defaults)
    with pytest.raises(PermissionError):
        save_calibration(model, {"chosen": {"exit_threshold": 0.5}, "tolerance": 0.01}, tmp_path)
    assert {path.name: path.read_text() for path in tmp_path.iterdir()} == before


def test_a_new_calibration_takes_the_earlier_ones_picture_away_unless_it_drew_its_own_there(tmp_path):
    """`publish` put the replaced calibration's tradeoff.png on the card of the new one."""
    report = {"chosen": {"exit_policy": "confidence", "exit_threshold": 0.5}, "tolerance": 0.01}
    (tmp_path / "tradeoff.png").write_bytes(b"the earlier sweep")
    save_calibration(tiny_model(), report, tmp_path, plot=tmp_path / "elsewhere.png")
    assert not (tmp_path / "tradeoff.png").exists()
    (tmp_path / "tradeoff.png").write_bytes(b"this sweep")
    save_calibration(tiny_model(), report, tmp_path, plot=tmp_path / "tradeoff.png")
    assert (tmp_path / "tradeoff.png").read_bytes() == b"this sweep"


def test_two_calibrations_writing_one_folder_take_turns(tmp_path):
    """Two `calibrate --write` into one folder at once could leave one's defaults beside the other's record."""
    import threading

    from hf_earlyexit.calibration import folder_locked

    model = tiny_model()
    report = {"chosen": {"exit_policy": "confidence", "exit_threshold": 0.5}, "tolerance": 0.01}
    writer = threading.Thread(target=save_calibration, args=(model, report, tmp_path))
    with folder_locked(tmp_path):  # another calibration is moving its files in
        writer.start()
        writer.join(timeout=1.0)
        assert writer.is_alive() and not (tmp_path / "calibration.json").exists()  # it waits its turn
    writer.join()
    assert json.loads((tmp_path / "calibration.json").read_text())["chosen"] == report["chosen"]


def test_a_file_system_without_locks_still_takes_the_calibration(tmp_path, monkeypatch):
    """NFS without lockd, some FUSE file systems: `flock` fails, and the write failed after the whole sweep."""
    import errno
    import fcntl

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    report = {"chosen": {"exit_policy": "confidence", "exit_threshold": 0.5}, "tolerance": 0.01}
    save_calibration(tiny_model(), report, tmp_path)
    assert json.loads((tmp_path / "calibration.json").read_text())["chosen"] == report["chosen"]


def test_a_setting_slower_than_the_full_model_is_never_chosen():
    """A threshold no token reaches pays the tests and skips nothing: `calibrate --write` saved it over good ones."""
    slower = [OperatingPoint({"exit_threshold": 0.99999}, 1.0, -0.05)]
    assert fastest_within_tolerance(slower, 1.0, 0.01) is None
    assert fastest_for_every_task({"vqa": (OperatingPoint({}, 1.0, 0.0), slower)}, 0.01) is None


def test_nothing_is_written_when_nothing_was_chosen(tmp_path):
    with pytest.raises(ValueError, match="within 1.0% of the full model and is expected to be faster than it: nothing"):
        save_calibration(tiny_model(), {"chosen": None, "tolerance": 0.01}, tmp_path)
    assert list(tmp_path.iterdir()) == []
