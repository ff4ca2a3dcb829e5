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
