"""Running a task through generate: predictions, exit layers (none past a sample's end), the full model despite
saved defaults, and the metric."""

import json

import pytest
import torch
from PIL import Image

from hf_earlyexit.data import train_tokenizer
from hf_earlyexit.evaluation import (
    TaskInputs,
    caption_images,
    disagreement,
    evaluate_task,
    relative_drop,
    run_knobs,
    run_task,
    score,
    task_inputs,
)
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from hf_earlyexit.tasks import get_task
from tests.helpers import tiny_model


def task_setup(name: str, samples: int = 6):
    task = get_task(name)
    rows = task.dataset("validation", size=samples)
    tokenizer = train_tokenizer([*rows["prompt"], *rows["target"]], vocab_size=300)
    processor = OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer)
    model = tiny_model(vocab_size=len(tokenizer), decompose_encoder_modalities=True, decoder_layers=4)
    return model, processor, TaskInputs.build(task, processor, rows, batch_size=4)


def test_run_task_records_exit_layers_up_to_each_samples_end():
    model, processor, inputs = task_setup("caption")
    full = run_task(model, processor, inputs)
    assert len(full.predictions) == 6 and full.encoder_exit_layers.tolist() == [[2, 2]] * 6
    assert set(full.decoder_exit_layers.unique().tolist()) <= {0, 4} and full.seconds > 0
    knobs = {"exit_policy": "confidence", "exit_threshold": 0.0, "encoder_image_exit_threshold": -1.0}
    early = run_task(model, processor, inputs, knobs)
    assert early.encoder_exit_layers[:, 0].tolist() == [1] * 6  # every image stream stops after layer 1
    assert set(early.decoder_exit_layers.unique().tolist()) <= {0, 1}
    generated = early.decoder_exit_layers > 0
    assert bool((generated[:, :-1] | ~generated[:, 1:]).all())  # zeros only after the generated tokens


def test_the_full_model_is_asked_for_explicitly_whatever_the_saved_defaults():
    model, processor, inputs = task_setup("vqa")
    full = run_task(model, processor, inputs)
    model.generation_config.exit_threshold = 0.0
    model.generation_config.exit_policy = "confidence"
    again = run_task(model, processor, inputs)
    assert again.predictions == full.predictions and torch.equal(again.decoder_exit_layers, full.decoder_exit_layers)


def test_score_uses_the_tasks_metric_and_disagreement_compares_answers():
    assert score(get_task("vqa"), ["Blue", "red"], ["blue", "green"]) == {"accuracy": 0.5}
    assert score(get_task("entailment"), ["yes"], ["yes"])["accuracy"] == 1.0
    captions = score(get_task("caption"), ["a red circle", "a blue square"], ["a red circle", "a green square"])
    assert captions["CIDEr"] > 0 and captions["METEOR"] is None and captions["SPICE"] is None
    assert score(get_task("caption"), ["a red circle"], ["a red circle"])["CIDEr"] is None  # 0 whatever the caption
    with pytest.raises(ValueError, match="caption: CIDEr-D .* score at least two"):
        score(get_task("caption"), ["a red circle"], ["a red circle"], per_sample=True)  # no loss to compute
    assert disagreement(["Yes", "no"], ["yes", "yes"]) == [0.0, 1.0]


def test_a_captions_loss_is_the_share_of_the_full_models_cider_it_lost():
    captions = ["a red circle left of a blue square", "a blue square", "a green circle"]
    targets = ["a red circle left of a blue square", "a blue square above a red circle", "a green triangle"]
    per_sample = score(get_task("caption"), captions, targets, per_sample=True)["CIDEr_per_sample"]
    full = [2.0, 1.0, 0.0]
    assert relative_drop(per_sample, full) == [
        min(1.0, max(0.0, (2.0 - per_sample[0]) / 2.0)),
        min(1.0, max(0.0, 1.0 - per_sample[1])),
        0.0,  # the full model scored nothing there: nothing to lose
    ]
    assert relative_drop([3.0, 0.0], [1.0, 1.0]) == [0.0, 1.0]  # a gain is no loss; the whole score lost is 1


def test_task_inputs_refuses_an_empty_split_and_an_unknown_task():
    _, processor, _ = task_setup("vqa", samples=2)
    assert task_inputs("vqa", processor, "validation", 3, 2).samples == 3
    with pytest.raises(ValueError, match="`samples` must be positive, got 0"):
        task_inputs("vqa", processor, "validation", 0, 2)
    with pytest.raises(ValueError, match="Unknown task 'ocr'"):
        task_inputs("ocr", processor, "validation", 2, 2)


def test_run_knobs_keep_the_saved_defaults_under_given_knobs_and_full_means_none():
    model = tiny_model(decoder_layers=4)
    assert run_knobs(model) == {}
    model.generation_config.exit_threshold, model.generation_config.exit_policy = 0.5, "confidence"
    saved = {"exit_threshold": 0.5, "exit_policy": "confidence"}
    assert run_knobs(model) == saved
    assert run_knobs(model, kv_strategy="copy") == {**saved, "kv_strategy": "copy"}
    assert run_knobs(model, exit_policy="similarity") == {"exit_threshold": 0.5, "exit_policy": "similarity"}
    assert run_knobs(model, full=True, kv_strategy="copy") == {}
    with pytest.raises(ValueError, match="Unknown early-exit knob"):
        run_knobs(model, exit_treshold=0.5)
    with pytest.raises(ValueError, match=r"`exit_threshold` is a confidence score's threshold .* got 2.5"):
        run_knobs(model, exit_threshold=2.5)  # checked as `generate` would, before any data loads


def test_run_knobs_in_speculative_mode_keep_the_saved_drafts_unless_the_exit_is_named():
    model = tiny_model(decoder_layers=4)
    saved = {"exit_threshold": 0.8, "exit_policy": "confidence", "draft_exit_threshold": 0.3, "kv_strategy": "copy"}
    for name, value in saved.items():
        setattr(model.generation_config, name, value)
    drafting = {"exit_mode": "speculative", "exit_threshold": 0.8, "exit_policy": "confidence"}
    assert run_knobs(model, exit_mode="speculative") == {**drafting, "draft_exit_threshold": 0.3}
    assert run_knobs(model, exit_mode="speculative", exit_threshold=0.5) == {**drafting, "exit_threshold": 0.5}
    assert run_knobs(model, exit_mode="speculative", exit_threshold=0.5, draft_exit_threshold=0.4) == {
        **drafting, "exit_threshold": 0.5, "draft_exit_threshold": 0.4,
    }  # fmt: skip
    # A lossy run's report names no saved draft: drafts serve speculative calls only.
    assert run_knobs(model) == {"exit_threshold": 0.8, "exit_policy": "confidence", "kv_strategy": "copy"}


def test_evaluate_task_reports_scores_and_the_flops_time_reduction():
    model, processor, _ = task_setup("vqa", samples=4)
    knobs = {"exit_policy": "confidence", "exit_threshold": 0.0}
    report = evaluate_task(model, processor, "vqa", split="validation", samples=4, batch_size=2, knobs=knobs)
    assert report["task"] == "vqa" and report["split"] == "validation" and report["samples"] == 4
    assert report["settings"] == knobs and 0 <= report["scores"]["accuracy"] <= 1
    assert 0 < report["expected_time_reduction_flops"] < 1 and report["seconds"] > 0
    # A step costs its deepest row: the batch-aware figure never promises more than the per-row one.
    assert report["expected_time_reduction_flops"] <= report["expected_time_reduction_flops_per_row"]
    full = evaluate_task(model, processor, "vqa", split="validation", samples=4, batch_size=2)
    assert full["settings"] == {} and full["expected_time_reduction_flops"] == 0
    fewer = evaluate_task(model, processor, "vqa", split="validation", samples=4, batch_size=32, knobs=knobs)
    assert fewer["batch_size"] == 4  # the rows decoded together, not the option
    speculative = {**knobs, "exit_mode": "speculative"}
    report = evaluate_task(model, processor, "vqa", split="validation", samples=4, batch_size=2, knobs=speculative)
    assert report["scores"] == full["scores"]  # the full model's answers
    assert report["expected_time_reduction_flops"] is None  # the verification runs what the drafts skipped
    assert report["drafted_tokens"] >= report["accepted_tokens"] and report["speculative_rounds"] >= 4


def test_a_report_with_a_users_controller_and_thresholds_per_request_is_json():
    model, processor, _ = task_setup("vqa", samples=4)
    knobs = {"exit_controller": {"decoder": FixedLayerExit(2)}, "exit_threshold": torch.tensor([0.5, 0.75])}
    report = evaluate_task(model, processor, "vqa", split="validation", samples=4, batch_size=2, knobs=knobs)
    assert json.loads(json.dumps(report))["settings"] == {
        "exit_controller": {"decoder": "FixedLayerExit(2)"}, "exit_threshold": [0.5, 0.75]
    }  # fmt: skip


def test_caption_images_gives_one_caption_per_image():
    model, processor, _ = task_setup("caption", samples=2)
    images = [Image.new("RGB", (40, 30), colour) for colour in ((200, 20, 20), (20, 20, 200))]
    captions, seconds = caption_images(model, processor, images, num_beams=2, max_new_tokens=3)
    assert len(captions) == 2 and all(isinstance(caption, str) for caption in captions) and seconds > 0
    one_by_one, _ = caption_images(model, processor, images, num_beams=2, max_new_tokens=3, batch_size=1)
    assert one_by_one == captions  # same-size images and prompts: batching changes nothing
    with pytest.raises(ValueError, match="batch_size"):
        caption_images(model, processor, images, batch_size=0)
