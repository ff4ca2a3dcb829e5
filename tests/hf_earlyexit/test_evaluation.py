"""Running a task through generate: predictions, exit layers (none past a sample's end), the full model despite
saved defaults, and the metric."""

import torch

from hf_earlyexit.data import train_tokenizer
from hf_earlyexit.evaluation import TaskInputs, disagreement, run_task, score
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
    captions = score(get_task("caption"), ["a red circle"], ["a red circle"])
    assert captions["CIDEr"] >= 0 and captions["METEOR"] is None and captions["SPICE"] is None
    assert disagreement(["Yes", "no"], ["yes", "yes"]) == [0.0, 1.0]
