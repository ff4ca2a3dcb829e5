"""The training scripts in examples/ run end to end (one step, on a tiny saved data set)."""

import runpy
import sys
from pathlib import Path

import pytest
from transformers import AutoModel

from tests.hf_earlyexit.test_data import shapes_dataset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    "script, heads",
    [
        ("train_mue_layerwise.py", {"decompose_encoder_modalities": True}),
        ("train_deed_deep_supervision.py", {"exit_adapter_dim": 64}),
        ("train_blipee_adversarial.py", {"exit_transformer_layers": [1, 2, 3]}),
        ("train_blipee_distill.py", {"exit_transformer_layers": [1, 2, 3]}),
    ],
)
def test_training_example_runs_and_saves_its_exit_heads(tmp_path, monkeypatch, script, heads):
    shapes_dataset(4).save_to_disk(tmp_path / "shapes")
    output = tmp_path / "trained"
    argv = [script, "--dataset", str(tmp_path / "shapes"), "--output-dir", str(output), "--max-steps", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--batch-size", "2"])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    config = AutoModel.from_pretrained(output, trust_remote_code=True).config
    assert {name: getattr(config, name) for name in heads} == heads


def test_embedded_model_recipe_teaches_the_image_stream_colour_before_the_tasks():
    from hf_earlyexit.training import small_model_and_processor

    recipe = runpy.run_path(str(EXAMPLES / "train_embedded_model.py"))
    model, processor = small_model_and_processor(
        ["a red circle", "is there a blue triangle?"],
        vocab_size=300,
        decompose_encoder_modalities=True,
        encoder_layers=2,
        decoder_layers=1,
        init_std=0.06,
    )
    untrained = recipe["pretrain_image_stream"](model, processor, steps=0, batch_size=32, seed=0)
    trained = recipe["pretrain_image_stream"](model, processor, steps=80, batch_size=32, seed=0)
    assert set(trained) == {"colour", "shape"}
    assert trained["colour"] > max(0.6, untrained["colour"] + 0.3)  # 8 colours: chance is 1/8
    assert model.training
