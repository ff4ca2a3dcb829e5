"""The `hf-earlyexit` command line: real runs and one-line errors."""

import json

import pytest
from PIL import Image

from hf_earlyexit.cli import main
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from tests.helpers import tiny_model
from tests.hf_earlyexit.test_data import shapes_dataset

TRAIN = ["train", "--max-steps", "1", "--batch-size", "2", "--dataset"]


@pytest.fixture
def model_dir(tmp_path, bart_tokenizer_dir):
    tokenizer = OFAProcessor.build_tokenizer(str(bart_tokenizer_dir))
    folder = tmp_path / "model"
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(folder)
    OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(folder)
    return folder


def test_caption_prints_one_line_per_image(model_dir, tmp_path, capsys):
    image = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 20, 20)).save(image)
    assert main(["caption", str(model_dir), str(image), str(image), "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(str(image) + "\t") for line in lines)


def test_convert_with_tokenizer_checks_the_vocabulary(reference_fixture, bart_tokenizer_dir, tmp_path, capsys):
    status = main(
        [
            "convert",
            "--from",
            str(reference_fixture),
            "--to",
            str(tmp_path / "out"),
            "--tokenizer",
            str(bart_tokenizer_dir),
        ]
    )
    assert status == 2  # the fixture's 1000-token vocabulary cannot take the 59457-token OFA tokenizer
    assert "59457 tokens but the model's vocabulary has 1000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make_argv", "message"),
    [
        (lambda d, t: ["caption", str(t / "nowhere"), str(t / "x.png")], "No image at"),
        (lambda d, t: ["caption", str(t), str(t / "not_image.png")], "Cannot read"),
        (lambda d, t: ["caption", str(t), str(t / "ok.png")], "not a model folder"),
        (lambda d, t: ["caption", str(t / "other_model"), str(t / "ok.png")], "not an hf-earlyexit OFA model"),
        (lambda d, t: ["convert", "--from", str(t / "nowhere"), "--to", str(t / "out")], "No checkpoint"),
        (lambda d, t: ["bench", "--forced-exit", "4", "--preset", "tiny"], "--forced-exit"),
        (lambda d, t: ["bench", "--forced-exit", "1", "--batch-sizes", "0"], "positive"),
        (lambda d, t: ["bench", "--training-step", "--exit-losses", "layerwise"], "must include 'none'"),
        (lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--exit-loss", "early"], "exit_loss"),
        (lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--target-column", "x"], "no column"),
        (lambda d, t: [*TRAIN, str(t / "nowhere"), "--output-dir", str(t / "o")], "nowhere"),
        (lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--model-dir", str(t)], "no config"),
        (
            lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--exit-transformer-layers", "a"],
            "comma-separated",
        ),
    ],
)
def test_user_errors_are_one_line(tmp_path, capsys, make_argv, message):
    shapes_dataset(2).save_to_disk(tmp_path / "shapes")
    (tmp_path / "not_image.png").write_text("this is not a png")
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "other_model").mkdir()
    (tmp_path / "other_model" / "config.json").write_text('{"model_type": "bert"}')
    capsys.readouterr()  # drop the set-up's progress bars
    assert main(make_argv(None, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-earlyexit: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_bench_prints_json_with_realized_and_ideal_speedups(capsys):
    argv = ["bench", "--forced-exit", "1", "--preset", "tiny", "--image-size", "64", "--batch-sizes", "1,2"]
    assert main([*argv, "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["forced_exit"] == 1 and set(report["encoder"]) == {"joint", "decomposed"}
    assert set(report["decoder"]) == {"batch_1", "batch_2"}
    for strategy in ("propagate", "copy", "recompute"):
        row = report["decoder"]["batch_2"][strategy]
        assert row["layer_count_speedup"] == 4.0  # OFA-tiny has 4 decoder layers
        assert row["realized_over_ideal"] == round(row["truncated_ms_per_token"] / row["early_exit_ms_per_token"], 3)


def test_bench_training_step_times_each_exit_loss(capsys):
    argv = ["bench", "--training-step", "--preset", "tiny", "--image-size", "32", "--batch-sizes", "1"]
    assert main([*argv, "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["seconds_per_step"]) == {"none", "layerwise"} and report["ratio_to_none"]["none"] == 1.0
    assert report["ratio_to_none"]["layerwise"] > 0


@pytest.mark.parametrize("exit_heads", [[], ["--exit-adapter-dim", "8", "--exit-loss", "deep_supervision"]])
def test_train_saves_a_model_that_loads_with_its_exit_heads(tmp_path, capsys, exit_heads):
    from transformers import AutoModel

    shapes_dataset().save_to_disk(tmp_path / "shapes")
    argv = [*TRAIN, str(tmp_path / "shapes"), "--output-dir", str(tmp_path / "trained"), *exit_heads]
    assert main(argv) == 0
    assert "saved the model and processor" in capsys.readouterr().out
    model = AutoModel.from_pretrained(tmp_path / "trained", trust_remote_code=True)
    assert model.config.exit_adapter_dim == (8 if exit_heads else None)
    assert (tmp_path / "trained" / "processor_config.json").is_file()


def test_demo_runs_end_to_end_and_shows_exit_layers(bart_tokenizer_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_EARLYEXIT_SHARED", str(bart_tokenizer_dir.parents[1]))
    assert main(["demo", "--output-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "max |logits - official OFA logits|" in out
    assert "decoder layers run per token [" in out
    assert (tmp_path / "demo" / "ofa-tiny" / "generation_early_exit.py").is_file()
