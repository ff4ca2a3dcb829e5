"""The training scripts in examples/ run end to end (one step, on a tiny saved data set)."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from hf_earlyexit.modeling.exit_knobs import resolve_knobs
from tests.hf_earlyexit.test_data import shapes_dataset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    "script, heads",
    [
        ("train_mue_layerwise.py", {"decompose_encoder_modalities": True}),
        (
            "train_deed_deep_supervision.py",
            {"exit_adapter_dim": 64, "exit_policy": "confidence", "kv_strategy": "recompute"},
        ),
        ("train_blipee_adversarial.py", {"exit_transformer_layers": [1, 2, 3]}),
        ("train_blipee_distill.py", {"exit_transformer_layers": [1, 2, 3]}),
        ("train_calm.py", {"exit_policy": "margin", "kv_strategy": "propagate"}),
    ],
)
def test_training_example_runs_and_saves_its_exit_heads(tmp_path, monkeypatch, script, heads):
    shapes_dataset(4).save_to_disk(tmp_path / "shapes")
    output = tmp_path / "trained"
    argv = [script, "--dataset", str(tmp_path / "shapes"), "--output-dir", str(output), "--max-steps", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--batch-size", "2"])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    model = AutoModel.from_pretrained(output, trust_remote_code=True)
    knobs = resolve_knobs(model.config, model.generation_config)  # the exit knobs a plain `generate` runs with
    assert {name: knobs[name] if name in knobs else getattr(model.config, name) for name in heads} == heads


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


def test_method_comparison_trains_every_method_from_one_start_and_reports_every_row(tmp_path, capsys):
    script = runpy.run_path(str(EXAMPLES / "compare_methods.py"))
    output = tmp_path / "methods"
    budget = ["--backbone-steps", "1", "--method-steps", "1", "--samples", "2", "--test-samples", "2"]
    argv = ["--quick", "--output-dir", str(output), "--tasks", "vqa", "--seeds", "0", "--batch-size", "2", *budget]
    report = script["main"]([*argv, "--timing-samples", "1"])

    recipes = json.loads((output / "recipes.json").read_text())["runs"]
    assert [recipe["run"] for recipe in recipes] == ["backbone", *script["METHODS"], *script["ABLATION_METHODS"]]
    backbone = output / "runs" / "backbone"
    assert "fresh decoder" in recipes[0]["started_from"]
    assert all(recipe["started_from"] == str(backbone) and recipe["steps"] == 1 for recipe in recipes[1:])
    config = {name: AutoModel.from_pretrained(output / "runs" / f"{name}-seed0", trust_remote_code=True).config
              for name in ("deed", "blipee", "mue_joint")}  # fmt: skip
    assert config["deed"].exit_adapter_dim == 64 and config["blipee"].exit_transformer_layers == [1, 2, 3, 4, 5]
    assert config["mue_joint"].decompose_encoder_modalities is False

    assert list(report["results"]) == list(script["ROWS"])
    for name, (result,) in report["results"].items():  # one seed
        assert set(result["validation_frontier"]) == {"vqa"}, name
        if result["chosen"] is not None:  # timed at batch 1 (the first seed) and 16, with its own full model
            assert set(result["test"]) == {"vqa@1", "vqa@16"}
            assert result["test"]["vqa@16"]["early_exit"]["settings"] == result["chosen"]
    assert set(report["ablations"]) == set(script["ABLATIONS"])
    assert set(report["encoder_streams"]["decomposed (MuE)"]) == {
        "vqa / encoder_image / 0.9",
        "vqa / encoder_text / 0.9",
    }
    assert set(report["encoder_streams"]["joint"]) == {"vqa / encoder / 0.9"}
    tables = (output / "tables.md").read_text()
    assert all(f"| {name} |" in tables for name in script["ROWS"]) and "Ablation: BLIPEE components" in tables
    assert (output / "tradeoff_vqa.png").stat().st_size > 0

    # A run already trained is reused, not trained again.
    written = (backbone / "model.safetensors").stat().st_mtime_ns
    options = script["parse_options"](argv)
    assert script["train_run"](options, "backbone", None, 1, 0, script["Method"]({})) == backbone
    assert (backbone / "model.safetensors").stat().st_mtime_ns == written


def test_method_comparison_names_a_bad_task(capsys):
    script = runpy.run_path(str(EXAMPLES / "compare_methods.py"))
    with pytest.raises(SystemExit):
        script["parse_options"](["--tasks", "vqa,poetry"])
    assert "unknown task(s) ['poetry']" in capsys.readouterr().err


def test_speculative_speed_at_ofa_base_size_prints_each_modes_timing_and_the_full_models_tokens(capsys):
    script = runpy.run_path(str(EXAMPLES / "speculative_ofa_base.py"))
    sizes = ["--batch-sizes", "1,2", "--new-tokens", "4", "--vocabulary-size", "64"]
    report = script["main"](["--preset", "tiny", "--repeats", "1", *sizes])
    assert json.loads(capsys.readouterr().out) == report
    for batch in report["batches"].values():
        for mode in ("speculative", "draft_vocabulary"):
            assert batch[mode]["same_outputs_as_full"] and batch[mode]["acceptance_rate"] > 0.5
    assert report["batches"]["batch_2"]["draft_vocabulary"]["size"] <= 64


def test_speculative_speed_at_ofa_base_size_with_rows_that_end_apart(capsys):
    script = runpy.run_path(str(EXAMPLES / "speculative_ofa_base.py"))
    report = script["main"](["--preset", "tiny", "--repeats", "1", "--batch-sizes", "4", "--new-tokens", "8",
                             "--vocabulary-size", "64", "--ends-apart"])  # fmt: skip
    capsys.readouterr()
    batch = report["batches"]["batch_4"]
    assert report["ends_apart"] and batch["speculative"]["same_outputs_as_full"]
    assert batch["draft_vocabulary"]["same_outputs_as_full"]
    lengths = script["RowLengths"]([2, 5])
    ended = lengths(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 3))
    assert ended.tolist() == [True, False]
