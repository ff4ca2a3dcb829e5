"""Choosing speculative mode's drafts by the clock: the choice rule on synthetic timings, the grid, the run on a
tiny model and the saved defaults."""

import dataclasses
import json

import pytest
import torch

from hf_earlyexit.draft_calibration import (
    DraftingPoint,
    calibrate_drafts,
    choose_for_batch_sizes,
    contenders,
    drafting_grid,
    fastest_drafts,
    frequent_tokens,
    largest_paying_batch_size,
    served_speedup,
    write_drafting_defaults,
)
from hf_earlyexit.modeling.modeling_ofa import EarlyExitOFAForConditionalGeneration
from tests.helpers import tiny_inputs, tiny_model
from tests.hf_earlyexit.test_evaluation import task_setup


def point(threshold: float, seconds: float, same: bool = True, k: int = 4) -> DraftingPoint:
    settings = {"draft_exit_policy": "confidence", "draft_exit_threshold": threshold, "num_assistant_tokens": k}
    return DraftingPoint(
        settings, seconds, 10.0, tokens=100, full_tokens=100, same_outputs=same, drafted=80, accepted=60, rounds=30
    )


def test_the_fastest_setting_on_every_task_that_never_loses_to_the_full_model():
    timings = {
        "caption": [point(0.2, 5.0), point(0.4, 6.0), point(0.6, 9.0)],
        "vqa": [point(0.2, 10.5), point(0.4, 9.0), point(0.6, 9.5)],  # 0.2 is slower than the full model here
    }
    assert fastest_drafts(timings)["draft_exit_threshold"] == 0.4
    timings["vqa"][1] = point(0.4, 9.0, same=False)  # a setting that changed an output is never chosen
    assert fastest_drafts(timings)["draft_exit_threshold"] == 0.6
    assert fastest_drafts({"vqa": [point(0.2, 11.0)]}) is None


def test_drafts_go_up_to_the_largest_batch_size_that_never_lost_on_any_task():
    assert largest_paying_batch_size({16: {"vqa": 1.1, "caption": 1.2}, 1: {}, 8: {"vqa": 1.0, "caption": 1.3}}) == 16
    assert largest_paying_batch_size({1: {}, 8: {"vqa": 1.05, "caption": 1.1}, 16: {"vqa": 0.9, "caption": 1.2}}) == 8
    assert largest_paying_batch_size({1: {}, 8: {"vqa": 0.99, "caption": 1.3}, 16: {"vqa": 1.1, "caption": 1.1}}) == 1
    assert largest_paying_batch_size({1: {"vqa": 0.9}, 8: {"vqa": 1.2}}) == 1  # lost at the smallest: no further


def test_contenders_are_the_settings_within_the_margin_of_the_best():
    timings = {
        "caption": [point(0.2, 5.0), point(0.4, 5.1), point(0.6, 6.0), point(0.8, 5.0, same=False)],
        "vqa": [point(0.2, 9.0), point(0.4, 9.0), point(0.6, 9.0), point(0.8, 9.0)],
    }
    assert [c["draft_exit_threshold"] for c in contenders(timings)] == [0.2, 0.4]  # best first; 0.6 is 9% behind
    assert [c["draft_exit_threshold"] for c in contenders(timings, margin=0.5)] == [0.2, 0.4, 0.6]
    assert contenders({"vqa": [point(0.2, 11.0)]}) == []


def test_the_served_speedup_counts_the_full_model_above_the_batch_limit():
    assert served_speedup({1: {"vqa": 1.5, "caption": 2.0}, 8: {"vqa": 1.2, "caption": 1.5}}) == pytest.approx(
        (1.5 * 2.0 * 1.2 * 1.5) ** 0.25
    )
    # It lost at 8 (and changed an output at 16): the full model decodes there.
    assert served_speedup({1: {"vqa": 1.5}, 8: {"vqa": 0.9}, 16: {"vqa": 0.0}}) == pytest.approx(1.5 ** (1 / 3))
    assert served_speedup({1: {"vqa": 0.0}}) == 0.0


def test_settings_alike_at_batch_1_are_told_apart_at_larger_batch_sizes():
    def timed(seconds: dict[int, float]) -> list[DraftingPoint]:  # draft length -> seconds
        return [point(0.2, value, k=k) for k, value in seconds.items()]

    timings = {  # eight drafts per round lead by 2% at batch 1, four pay at batch 8 where eight lose
        1: {"caption": timed({8: 5.0, 4: 5.1}), "vqa": timed({8: 8.0, 4: 8.1})},
        8: {"caption": timed({8: 11.0, 4: 9.0}), "vqa": timed({8: 10.5, 4: 9.5})},
    }
    chosen, report = choose_for_batch_sizes(timings)
    assert chosen["num_assistant_tokens"] == 4 and chosen["draft_max_batch_size"] == 8
    assert report["draft_max_batch_size"] == 8 and set(report["batch_sizes"]) == {8}
    assert report["batch_sizes"][8]["caption"]["speedup_over_full"] == round(10 / 9, 3)
    assert [c["settings"]["num_assistant_tokens"] for c in report["contenders"]] == [4, 8]
    assert [c["draft_max_batch_size"] for c in report["contenders"]] == [8, 1]
    timings[8]["vqa"][1] = point(0.2, 9.5, same=False, k=4)  # a setting that changed an output does not pay there
    chosen, report = choose_for_batch_sizes(timings)
    assert chosen == {**point(0.2, 5.0, k=8).settings, "draft_max_batch_size": 1}


def test_a_points_report_counts_per_round_and_against_the_full_model():
    report = point(0.2, 5.0).report()
    assert report["speedup_over_full"] == 2.0 and report["tokens_per_second"] == 20.0
    assert report["acceptance_rate"] == 0.75 and report["tokens_per_round"] == round(100 / 30, 3)
    idle = dataclasses.replace(point(0.2, 5.0), drafted=0, accepted=0, rounds=0).report()  # no call drafted
    assert idle["acceptance_rate"] is None and idle["tokens_per_round"] is None  # was 100 tokens "per round"


def test_a_draft_vocabulary_is_the_references_most_frequent_tokens():
    from transformers import AutoProcessor

    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR

    processor = AutoProcessor.from_pretrained(EMBEDDED_MODEL_DIR)
    targets = ["a red circle", ["a red square", "red"]]  # a sample may have several references
    (a, red, circle), end = processor.tokenizer(" a red circle")["input_ids"][1:-1], processor.tokenizer.eos_token_id
    assert frequent_tokens(processor, targets, 2) == sorted([red, end])  # three of each: ties go by id
    assert frequent_tokens(processor, targets, 3)[2] == a and circle in frequent_tokens(processor, targets, 9)
    assert len(frequent_tokens(processor, targets, 9)) == 5  # every token the references hold, the end once
    with pytest.raises(ValueError, match="positive integer"):
        frequent_tokens(processor, targets, 0)


def test_the_grid_is_every_policy_threshold_draft_length_and_schedule():
    grid = drafting_grid({"confidence": (0.2, 0.4), "fixed_layer": (1,)}, (2, 8))
    heuristic = {"num_assistant_tokens": 8, "num_assistant_tokens_schedule": "heuristic"}
    assert len(grid) == 12 and {"draft_exit_policy": "fixed_layer", "draft_exit_threshold": 1, **heuristic} in grid
    assert len(drafting_grid({"confidence": (0.2,)}, (2, 8), ("constant",))) == 2
    for bad in ((0,), (), (2.5,)):
        with pytest.raises(ValueError, match="num_assistant_tokens"):
            drafting_grid({"confidence": (0.2,)}, bad)
    for bad in (("often",), ()):
        with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
            drafting_grid({"confidence": (0.2,)}, (4,), bad)


def test_calibrate_drafts_times_every_setting_beside_the_full_model(tmp_path):
    model, processor, _ = task_setup("caption", samples=4)
    report = calibrate_drafts(
        model, processor, ["caption"], samples=4, batch_size=2, thresholds={"confidence": (0.0, 0.5)},
        draft_tokens=(2,), repeats=1, progress=False, schedules=("constant",),
    )  # fmt: skip
    task = report["tasks"]["caption"]
    assert report["points"] == 2 and report["batch_size"] == 2 and len(task["points"]) == 2
    assert report["device"].startswith("cpu (") and report["dtype"] == "float32"  # drafts pay by this device's clock
    assert all(p["same_outputs_as_full"] for p in task["points"])  # lossless whatever drafts
    speedups = [p["speedup_over_full"] for p in task["points"]]
    assert speedups == sorted(speedups, reverse=True) and task["full_tokens_per_second"] > 0
    # The clock decides, so only the rule is checked: the fastest setting if it kept up with the full model.
    assert report["chosen"] == (task["points"][0]["settings"] if speedups[0] >= 1 else None)
    if report["chosen"] is None:
        with pytest.raises(ValueError, match="nothing written"):
            calibrate_drafts(
                model, processor, ["caption"], samples=4, batch_size=2, thresholds={"confidence": (0.5,)},
                draft_tokens=(2,), repeats=1, write_to=tmp_path, progress=False,
            )  # fmt: skip
        assert not (tmp_path / "generation_config.json").exists()
    with pytest.raises(ValueError, match="No drafting setting"):
        calibrate_drafts(model, processor, ["caption"], samples=4, thresholds={}, progress=False)


def test_saved_drafts_round_trip_and_leave_the_lossy_defaults(tmp_path):
    model = tiny_model(decoder_layers=4)
    write_drafting_defaults(model, {"exit_policy": "similarity", "exit_threshold": 0.9})
    chosen = {"draft_exit_policy": "fixed_layer", "draft_exit_threshold": 1, "num_assistant_tokens": 3,
              "num_assistant_tokens_schedule": "heuristic", "draft_max_batch_size": 2}  # fmt: skip
    write_drafting_defaults(model, chosen)
    model.save_pretrained(tmp_path)
    loaded = EarlyExitOFAForConditionalGeneration.from_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert {name: saved[name] for name in chosen} == chosen and saved["exit_threshold"] == 0.9
    assert "exit_mode" not in saved  # the default mode stays the user's choice
    with torch.no_grad():
        out = loaded.generate(**tiny_inputs(batch=1), max_new_tokens=6, exit_mode="speculative",
                              return_dict_in_generate=True)  # fmt: skip
    assert set(out.exit_layers[out.exit_layers > 0].tolist()) <= {1, 4}  # drafts at layer 1
    with torch.no_grad():
        above = loaded.generate(**tiny_inputs(batch=3), max_new_tokens=6, exit_mode="speculative",
                                return_dict_in_generate=True)  # fmt: skip
    assert set(above.exit_layers.unique().tolist()) == {4} and not bool(above.drafted_tokens.any())  # in full
    with pytest.raises(ValueError, match="draft_exit_threshold"):
        write_drafting_defaults(model, {"draft_exit_policy": "confidence", "draft_exit_threshold": 2.0})
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        write_drafting_defaults(model, {"num_assistant_tokens_schedule": "often"})
