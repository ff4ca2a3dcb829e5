"""The `hf-earlyexit` command line: real runs and one-line errors."""

import json

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig

from hf_earlyexit.benchmark import device_name
from hf_earlyexit.cli import main
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from tests.helpers import tiny_model
from tests.hf_earlyexit.test_data import shapes_dataset

TRAIN = ["train", "--max-steps", "1", "--batch-size", "2", "--dataset"]
NO_THRESHOLDS = ["calibrate", "{m}", "--tasks", "vqa", "--encoder-thresholds", "", "--similarity-thresholds", ""]
NO_THRESHOLDS += ["--confidence-thresholds", ""]  # a grid with nothing to sweep


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


def test_caption_in_speculative_mode_prints_the_full_models_greedy_captions(tmp_path, capsys):
    from hf_earlyexit.evaluation import caption_images
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, load_model_and_processor
    from hf_earlyexit.modeling.exit_knobs import NO_EXIT
    from hf_earlyexit.tasks import get_task

    images = list(get_task("caption").dataset("test", size=3)["image"])
    paths = [str(tmp_path / f"{index}.png") for index in range(len(images))]
    for image, path in zip(images, paths, strict=True):
        image.save(path)
    assert main(["caption", str(EMBEDDED_MODEL_DIR), *paths, "--exit-mode", "speculative"]) == 0  # greedy: 1 beam
    printed = [line.split("\t")[1] for line in capsys.readouterr().out.strip().splitlines()]
    model, processor = load_model_and_processor(EMBEDDED_MODEL_DIR)
    expected, _ = caption_images(model, processor, images, num_beams=1, **NO_EXIT)
    assert printed == [caption.strip() for caption in expected]


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
    err = capsys.readouterr().err
    assert "59457 tokens but the model's vocabulary has 1000" in err
    assert not (tmp_path / "out").exists()  # checked before anything is written: no model without its processor
    argv = ["convert", "--from", str(reference_fixture), "--to", str(tmp_path / "out"), "--tokenizer", "/nowhere"]
    assert main(argv) == 2 and "No tokenizer folder at /nowhere" in capsys.readouterr().err
    assert main(argv[:-2]) == 0  # without a tokenizer it says what the folder lacks (every later command failed)
    assert "saved no processor: the other commands need one; convert again with --tokenizer" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make_argv", "message"),
    [
        (lambda d, t: ["caption", str(t / "nowhere"), str(t / "x.png")], "No image at"),
        (lambda d, t: ["caption", str(t), str(t / "not_image.png")], "Cannot read"),
        (lambda d, t: ["caption", str(t), str(t / "ok.png")], "not a model folder"),
        (lambda d, t: ["caption", str(t / "other_model"), str(t / "ok.png")], "not an hf-earlyexit OFA model"),
        (lambda d, t: ["caption", str(t / "list_config"), str(t / "ok.png")], "holds a list, not a JSON object"),
        (lambda d, t: ["caption", str(t / "bad_json"), str(t / "ok.png")], "config.json is not JSON"),
        (lambda d, t: ["convert", "--from", str(t / "nowhere"), "--to", str(t / "out")], "No checkpoint"),
        (lambda d, t: ["bench", "--forced-exit", "4", "--preset", "tiny"], "--forced-exit"),
        (lambda d, t: ["bench", "--forced-exit", "1", "--batch-sizes", "0"], "positive"),
        (lambda d, t: ["bench", "--training-step", "--exit-losses", "layerwise"], "must include 'none'"),
        (lambda d, t: ["bench", "--forced-exit", "1", "--preset", "tiny", "--device", "gpu0"], "torch device"),
        (lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--exit-loss", "early"], "exit_loss"),
        (lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--target-column", "x"], "no column"),
        (
            lambda d, t: [*TRAIN, str(t / "shapes"), "--output-dir", str(t / "o"), "--target-column", ""],
            "--target-column is empty",
        ),
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
    for folder, text in (("list_config", "[1, 2]"), ("bad_json", "{model_type: ofa}")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(text)
    capsys.readouterr()  # drop the set-up's progress bars
    assert main(make_argv(None, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-earlyexit: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_bench_prints_json_with_realized_and_ideal_speedups(capsys):
    argv = ["bench", "--forced-exit", "1", "--preset", "tiny", "--image-size", "64", "--batch-sizes", "1,2"]
    assert main([*argv, "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert "timing OFA-tiny" in printed.err and "4/4" in printed.err  # its progress: two encoders, two batch sizes
    assert report["forced_exit"] == 1 and set(report["encoder"]) == {"joint", "decomposed"}
    assert set(report["decoder"]) == {"batch_1", "batch_2"}
    for strategy in ("propagate", "copy", "recompute"):
        row = report["decoder"]["batch_2"][strategy]
        assert row["layer_count_speedup"] == 4.0  # OFA-tiny has 4 decoder layers
        # Rounded to 3 decimals from the times before they were rounded: equal to the printed times' ratio within that.
        assert row["realized_over_ideal"] == pytest.approx(
            row["truncated_ms_per_token"] / row["early_exit_ms_per_token"], abs=1e-3
        )
    assert report["decoder_patterns"]["batch_1"] == {}  # every pattern is a uniform exit at batch 1
    patterns = report["decoder_patterns"]["batch_2"]
    assert set(patterns) == {"alternating", "one_row_deep", "each_row_own_layer"}
    for row in patterns.values():  # one round: each ratio is the ratio of the round's times
        for plan in ("auto", "keep", "compact"):
            assert row[f"{plan}_speedup_over_full"] == pytest.approx(
                row["full_ms_per_token"] / row[f"{plan}_ms_per_token"], rel=0.01
            )
            assert row[f"{plan}_over_floor"] == pytest.approx(
                row[f"{plan}_ms_per_token"] / row["floor_ms_per_token"], rel=0.01
            )
    assert patterns["alternating"]["deepest_exit"] == 4 and patterns["each_row_own_layer"]["deepest_exit"] == 2
    assert set(report["decoder_plan"]) == {"batch_2"}
    plan = report["decoder_plan"]["batch_2"]
    assert plan["rows"] == [1, 2] and len(plan["kept_layer_ms"]) == 2
    assert plan["auto_with_1_of_2_going_on"] in ("keep", "compact")


def test_bench_training_step_times_each_exit_loss(capsys):
    argv = ["bench", "--training-step", "--preset", "tiny", "--image-size", "32", "--batch-sizes", "1"]
    assert main([*argv, "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert "timing a training step per exit loss" in printed.err
    assert set(report["seconds_per_step"]) == {"none", "layerwise"} and report["ratio_to_none"]["none"] == 1.0
    assert report["ratio_to_none"]["layerwise"] > 0


@pytest.mark.parametrize(
    "exit_heads",
    [[], ["--exit-adapter-dim", "8", "--exit-loss", "deep_supervision"], ["--exit-loss-weights", "increasing"]],
)
def test_train_saves_a_model_that_loads_with_its_exit_heads(tmp_path, capsys, exit_heads):
    from transformers import AutoModel

    shapes_dataset().save_to_disk(tmp_path / "shapes")
    argv = [*TRAIN, str(tmp_path / "shapes"), "--output-dir", str(tmp_path / "trained"), *exit_heads]
    assert main(argv) == 0
    assert "saved the model and processor" in capsys.readouterr().out
    model = AutoModel.from_pretrained(tmp_path / "trained", trust_remote_code=True)
    assert model.config.exit_adapter_dim == (8 if "--exit-adapter-dim" in exit_heads else None)
    assert (tmp_path / "trained" / "processor_config.json").is_file()


def test_a_stopped_train_run_resumes_from_its_last_checkpoint(tmp_path, capsys, monkeypatch):
    from transformers import AutoModel

    from hf_earlyexit import EarlyExitTrainer

    shapes_dataset().save_to_disk(tmp_path / "shapes")
    argv = [*TRAIN, str(tmp_path / "shapes"), "--output-dir", str(tmp_path / "run"), "--save-steps", "1"]
    argv[argv.index("--max-steps") + 1] = "2"

    save_model = EarlyExitTrainer.save_model

    def stopped(trainer, output_dir=None, **kwargs):  # checkpoints save, the final model does not
        if output_dir is None:
            raise OSError("No space left on device")
        return save_model(trainer, output_dir, **kwargs)

    with monkeypatch.context() as patched:  # the run stops after its last step, before saving the model
        patched.setattr(EarlyExitTrainer, "save_model", stopped)
        assert main(argv) == 2
    run = {"checkpoint-2", "training_recipe.json"}  # the last checkpoint kept, and the recipe the run started with
    assert {path.name for path in (tmp_path / "run").iterdir()} == run
    capsys.readouterr()
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err  # never over the stopped run
    steps = argv.index("--max-steps") + 1
    argv[steps] = "1"
    assert main([*argv, "--resume"]) == 2  # it would save a model trained longer than asked; the checkpoint stays
    assert "stopped at step 2, which --max-steps 1 leaves nothing after" in capsys.readouterr().err
    argv[steps] = "3"
    heads = ["--exit-adapter-dim", "8", "--exit-loss", "deep_supervision"]  # not the model the run trained
    assert main([*argv, *heads, "--resume"]) == 2
    err = capsys.readouterr().err  # every option given otherwise is named
    assert (
        "continues the stopped run as it started (training_recipe.json): exit_adapter_dim=None there, 8 here; " in err
    )
    assert "exit_loss='layerwise' there, 'deep_supervision' here. Give the same options" in err
    assert main([*argv, "--learning-rate", "0.5", "--resume"]) == 2  # nor its optimisation
    assert "learning_rate=0.0001 there, 0.5 here" in capsys.readouterr().err
    assert {path.name for path in (tmp_path / "run").iterdir()} == run
    # Without --max-steps, the stopped run's 2 (not 1000), which are done (it stopped before saving the model): the
    # checkpoint is the model.
    assert main([*argv[: steps - 1], *argv[steps + 1 :], "--resume"]) == 2
    assert (
        "checkpoint-2 stopped at step 2, which --max-steps 2 leaves nothing after: that folder holds the trained"
        in (capsys.readouterr().err)
    )
    assert AutoModel.from_pretrained(tmp_path / "run" / "checkpoint-2", trust_remote_code=True).config.decoder_layers
    (tmp_path / "run" / "checkpoint-3").mkdir()  # a run stopped while saving: skipped for the last complete one
    argv[steps] = "3"
    vocabulary = OFAProcessor.from_pretrained(tmp_path / "run" / "checkpoint-2").tokenizer.get_vocab()
    other = shapes_dataset().map(lambda row: {"question": "which shape is drawn here?", "answer": "a square"})
    other.save_to_disk(tmp_path / "other")  # data with other words: a new tokenizer would number them otherwise
    argv[argv.index("--dataset") + 1] = str(tmp_path / "other")
    assert main([*argv, "--resume"]) == 2 and "dataset='" in capsys.readouterr().err  # not the run's data
    recipe = json.loads((tmp_path / "run" / "training_recipe.json").read_text())
    (tmp_path / "run" / "training_recipe.json").unlink()  # a run from before recipes: the weights are checked
    assert main([*argv, *heads, "--resume"]) == 2
    assert "holds another model's weights" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # the saved model replaces the checkpoints
    assert AutoModel.from_pretrained(tmp_path / "run", trust_remote_code=True).config.decoder_layers > 0
    assert OFAProcessor.from_pretrained(tmp_path / "run").tokenizer.get_vocab() == vocabulary  # the run's own
    assert recipe["options"]["max_steps"] == 2 and recipe["options"]["exit_loss"] == "layerwise"
    assert main([*argv, "--resume"]) == 2 and "no complete checkpoint" in capsys.readouterr().err


def test_a_run_that_failed_before_its_first_checkpoint_can_be_run_again(tmp_path, capsys):
    """It left its recipe alone in the output folder, which then refused a new run and had nothing to resume."""
    from PIL import Image

    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (32, 32), "red").save(folder / "red.png")
    rows = [{"image": "red.png", "question": " what color?", "answer": "red"}] * 3
    (folder / "train.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in [*rows, {**rows[0], "image": "no.png"}])
    )
    argv = [*TRAIN, f"json:{folder}", "--output-dir", str(tmp_path / "run"), "--batch-size", "4"]
    # A missing image is named with its row before the run starts (the collator met it at its batch, as "row 1").
    assert main(argv) == 2 and "Column 'image', row 3: no image at" in capsys.readouterr().err
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["training_recipe.json"]  # replaced next time
    (folder / "bad.png").write_bytes(b"not an image")  # found only where the collator opens it, in the first step
    (folder / "train.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in [*rows, {**rows[0], "image": "bad.png"}])
    )
    assert main(argv) == 2 and "bad.png" in capsys.readouterr().err
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["training_recipe.json"]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 2))
    assert main(argv) == 0


def test_train_refuses_what_it_would_overwrite_or_could_not_load_in_one_line(tmp_path, capsys):
    shapes_dataset().save_to_disk(tmp_path / "shapes")
    shapes, trained = str(tmp_path / "shapes"), tmp_path / "trained"
    heads = ["--exit-adapter-dim", "8", "--exit-loss", "deep_supervision"]
    assert main([*TRAIN, shapes, "--output-dir", str(trained), *heads]) == 0
    saved = {path.name: path.read_bytes() for path in trained.iterdir()}
    capsys.readouterr()
    # Into the folder of the model it starts from, or of an earlier run: its other files would describe lost weights.
    assert main([*TRAIN, shapes, "--model-dir", str(trained), "--output-dir", str(trained), *heads]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in trained.iterdir()} == saved
    # Heads of another width than the saved ones, which cannot load their weights.
    other = ["--output-dir", str(tmp_path / "other"), "--exit-adapter-dim", "4", "--exit-loss", "deep_supervision"]
    assert main([*TRAIN, shapes, "--model-dir", str(trained), *other]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "exit_adapter_dim=8" in error
    assert main([*TRAIN, shapes, "--output-dir", str(tmp_path / "prompted"), "--prompt", " what is it?"]) == 2
    assert "--text-column '' with --prompt" in capsys.readouterr().err  # the rows' questions would be used instead
    with pytest.raises(SystemExit) as exited:  # a width of 0 is no width, not "no heads"
        main([*TRAIN, shapes, "--output-dir", str(tmp_path / "zero"), "--exit-adapter-dim", "0"])
    assert exited.value.code == 2 and "--exit-adapter-dim" in capsys.readouterr().err
    assert main([*TRAIN, shapes, "--output-dir", str(tmp_path / "weights"), "--exit-loss-weights", "1,2"]) == 2
    assert "`exit_loss_weights` has 2 weights, but exit_loss='layerwise' has" in capsys.readouterr().err
    for rate in ("inf", "0", "nan"):  # inf trained to NaN weights and 0 trained nothing, each saved as a model
        with pytest.raises(SystemExit):
            main([*TRAIN, shapes, "--output-dir", str(tmp_path / "rate"), "--learning-rate", rate])
        assert f"--learning-rate: must be a finite number above 0, got '{rate}'" in capsys.readouterr().err


@pytest.fixture
def task_model_dir(tmp_path):
    """A tiny random model with MuE's decomposed encoder, a BPE trained on the tasks' text, 64 px images."""
    from hf_earlyexit.data import train_tokenizer
    from hf_earlyexit.tasks import get_task

    texts = [text for name in ("vqa", "caption") for column in ("prompt", "target")
             for text in get_task(name).dataset("validation", size=50)[column]]  # fmt: skip
    tokenizer = train_tokenizer(texts, vocab_size=300)
    folder = tmp_path / "task_model"
    tiny_model(vocab_size=len(tokenizer), decompose_encoder_modalities=True, decoder_layers=4).save_pretrained(folder)
    OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(folder)
    return folder


def test_eval_prints_the_tasks_scores_and_time_reduction(task_model_dir, capsys):
    argv = ["eval", str(task_model_dir), "--task", "vqa", "--split", "validation", "--samples", "6", "--json"]
    assert main([*argv, "--exit-policy", "confidence", "--exit-threshold", "0", "--kv-strategy", "copy"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert "Filter" not in printed.err and "Map" not in printed.err  # the data set's steps, under the CLI's progress
    assert report["samples"] == 6 and 0 <= report["scores"]["accuracy"] <= 1
    assert report["settings"] == {"exit_policy": "confidence", "exit_threshold": 0.0, "kv_strategy": "copy"}
    assert 0 < report["expected_time_reduction_flops"] < 1  # every token left after decoder layer 1 of 4
    assert "risk_against_full" not in report


def test_eval_against_the_full_model_reports_the_risk_a_certificate_bounds(task_model_dir, capsys):
    argv = ["eval", str(task_model_dir), "--task", "caption", "--split", "calibration", "--samples", "4", "--json"]
    assert main([*argv, "--against-full", "--exit-policy", "confidence", "--exit-threshold", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    risk = report["risk_against_full"]
    assert risk["loss"] == "bounded" and 0 <= risk["mean"] <= 1 and "CIDEr_per_sample" not in report["scores"]
    assert main([*argv, "--against-full", "--full"]) == 0  # the full model against itself loses nothing
    assert json.loads(capsys.readouterr().out)["risk_against_full"] == {"loss": "bounded", "mean": 0.0}


def test_calibrate_writes_the_choice_and_bench_measures_it(task_model_dir, tmp_path, capsys):
    from PIL import Image

    from hf_earlyexit.loading import weights_fingerprint

    plot = tmp_path / "tradeoff.png"
    # VQA only: on this random model every setting that saves time loses all of the captions' CIDEr (the full
    # model's 0.007), and one that is slower than the full model is never chosen.
    argv = ["calibrate", str(task_model_dir), "--tasks", "vqa", "--samples", "4", "--batch-size", "4"]
    thresholds = ["--similarity-thresholds", "0.9", "--confidence-thresholds", "0.0", "--encoder-thresholds", "-1"]
    thresholds += ["--exit-token-layers", "own,batch", "--max-exit-layers", "any,1"]
    assert main([*argv, *thresholds, "--tolerance", "0.99", "--plot", str(plot), "--write", "--quiet", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["points"] == (1 + 2 * 2 * 2) * 2 * 2 - 1 and set(report["tasks"]) == {"vqa"}
    assert report["batch_size"] == 4  # the time reductions, hence the choice, are for batches of 4
    for task in report["tasks"].values():
        chosen_point = task["chosen"]
        assert chosen_point["expected_time_reduction"] <= chosen_point["per_row_time_reduction"]
    chosen = report["chosen"]
    assert chosen is not None and report["tasks"]["vqa"]["chosen"]["expected_time_reduction"] > 0
    # Threshold -1 stops a stream after its first layer, so no encoder exit test is skipped.
    encoder_exits = any(name.startswith("encoder") and name.endswith("exit_threshold") for name in chosen)
    assert chosen.get("encoder_min_exit_layer") == (1 if encoder_exits else None)
    saved = json.loads((task_model_dir / "generation_config.json").read_text())
    assert all(saved[name] == value for name, value in chosen.items())
    weights = weights_fingerprint(task_model_dir)  # the records name the weights they were measured on
    assert json.loads((task_model_dir / "calibration.json").read_text())["chosen"] == chosen
    assert json.loads((task_model_dir / "calibration.json").read_text())["weights"] == weights
    assert Image.open(plot).size[0] > 0

    argv = ["bench", str(task_model_dir), "--task", "vqa", "--samples", "4", "--batch-size", "2", "--repeats", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    from hf_earlyexit.modeling.exit_knobs import EXIT_KNOBS

    saved = {name: value for name, value in chosen.items() if value != EXIT_KNOBS[name]}  # defaults are implied
    assert report["task"] == "vqa" and report["metric"] == "accuracy" and report["early_exit"]["settings"] == saved
    assert report["weights"] == weights and len(weights) == 16
    for side in ("full", "early_exit"):
        assert {"quality", "seconds"} <= set(report[side]) and report[side]["seconds"] > 0
    # Below 0 where the controller's tests cost more than the layers they save (a tiny model's few tokens).
    assert -1 < report["early_exit"]["expected_time_reduction"] < 1
    assert report["early_exit"]["expected_time_reduction_flops"] >= 0  # FLOPs count layers only
    assert report["early_exit"]["parameter_speedup"] >= 1  # BLIPEE's measure: never more than the full model's
    ratio = report["early_exit"]["seconds"] / report["full"]["seconds"]
    assert report["wall_clock_time_reduction"] == pytest.approx(1 - ratio, abs=1e-4)
    assert set(report["per_part_seconds"]) >= {"decoder_layer_per_token", "encoder_image_layer_per_sample"}
    asked = report["per_part_seconds"]["decoder_layers_asked"]
    last_asked = saved.get("max_exit_layer") or 3  # 4 decoder layers: exits after 1, 2 and 3
    assert asked == (list(range(1, last_asked + 1)) if "exit_threshold" in saved else [])
    assert report["per_part_seconds"]["decoder_ask_per_token"] >= 0

    assert report["device"].startswith("cpu (") and report["dtype"] == "float32"
    compiled = report["full_compiled"]  # by default, the compiled full model beside the eager one
    assert compiled["same_outputs_as_full"] and compiled["quality"] == report["full"]["quality"]
    assert compiled["speedup_over_full"] == pytest.approx(report["full"]["seconds"] / compiled["seconds"], rel=1e-2)
    assert report["early_exit"]["speedup_over_compiled_full"] > 0

    argv.append("--no-compiled-full")  # compiling takes tens of seconds: once is enough here
    assert main([*argv, "--json"]) == 0 and "full_compiled" not in json.loads(capsys.readouterr().out)
    assert main([*argv, "--kv-strategy", "copy", "--json"]) == 0  # one knob given: the calibrated ones stay
    assert json.loads(capsys.readouterr().out)["early_exit"]["settings"] == {**saved, "kv_strategy": "copy"}
    off = ["--exit-threshold", "none", "--encoder-image-exit-threshold", "0.5", "--json"]  # 'none': whatever is saved
    assert main([*argv, *off]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["early_exit"]["settings"]["exit_threshold"] is None
    assert (
        report["per_part_seconds"]["decoder_layers_asked"] == []
        and report["early_exit"]["mean_layers"]["decoder_per_token"] == 4
    )
    speculative_argv = [*argv, "--exit-mode", "speculative", "--exit-threshold", "0.5", "--exit-policy", "confidence"]
    assert main([*speculative_argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    speculative = report["speculative"]
    assert speculative["same_outputs_as_full"] and speculative["quality"] == report["full"]["quality"]
    assert speculative["settings"]["exit_mode"] == "speculative"
    assert report["early_exit"]["settings"].get("exit_mode", "exit") == "exit"  # the lossy exits beside it
    generation_config = GenerationConfig.from_pretrained(task_model_dir)
    generation_config.encoder_image_exit_threshold = generation_config.encoder_text_exit_threshold = 0.5
    generation_config.save_pretrained(task_model_dir)
    off = ["--encoder-image-exit-threshold", "none", "--encoder-text-exit-threshold", "none", "--json"]
    assert main([*speculative_argv, *off]) == 0  # given for both sides, over the saved ones: the lossy side keeps them
    lossy = json.loads(capsys.readouterr().out)["early_exit"]
    assert lossy["settings"]["encoder_image_exit_threshold"] is None
    encoder_layers = json.loads((task_model_dir / "config.json").read_text())["encoder_layers"]
    assert lossy["mean_layers"]["encoder_image"] == lossy["mean_layers"]["encoder_text"] == encoder_layers
    assert {"tokens_per_second", "acceptance_rate", "tokens_per_round", "speedup_over_full"} <= set(speculative)
    assert sum(speculative["round_time_shares"][part] for part in ("draft", "verification", "bookkeeping")) == (
        pytest.approx(1, abs=0.01)
    )
    assert main([*argv, "--dtype", "bfloat16", "--json"]) == 0  # --dtype reaches the task benchmark's model
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bfloat16" and report["full"]["seconds"] > 0


def test_calibrate_prints_its_report_when_writing_it_fails(task_model_dir, capsys, monkeypatch):
    from hf_earlyexit import calibration

    def full_disk(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(calibration, "save_calibration", full_disk)
    argv = ["calibrate", str(task_model_dir), "--tasks", "vqa", "--samples", "4", "--batch-size", "2", "--quiet"]
    grid = ["--confidence-thresholds", "0.0", "--similarity-thresholds", "", "--encoder-thresholds", ""]
    assert main([*argv, *grid, "--tolerance", "0.99", "--write", "--json"]) == 2
    printed = capsys.readouterr()
    assert json.loads(printed.out)["chosen"] is not None  # the sweep's report is kept
    assert printed.err.strip().endswith("No space left on device")


def test_calibrate_with_a_risk_says_when_nothing_is_certified_and_what_would_be(task_model_dir, capsys):
    argv = ["calibrate", str(task_model_dir), "--tasks", "vqa", "--samples", "8", "--batch-size", "2", "--quiet"]
    grid = ["--confidence-thresholds", "1.0", "--similarity-thresholds", "", "--encoder-thresholds", "1.0"]  # no exit
    assert main([*argv, *grid, "--risk", "0.01", "--delta", "0.2", "--json"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert report["chosen"] is None and report["risk_level"] == {"vqa": 0.01} and "tolerance" not in report
    certificate = report["tasks"]["vqa"]["certificate"]
    assert certificate["tested_samples"] == 6 and certificate["stopped_at"]["samples_needed"] == 161  # 2 order
    assert "No setting is certified on every task at its risk level (vqa 1.0%" in printed.err
    assert "{'vqa': 161}" in printed.err
    assert main([*argv, *grid, "--risk", "0.01", "--delta", "0.2", "--write", "--json"]) == 2  # nothing to write
    printed = capsys.readouterr()
    kept = json.loads(printed.out)  # the sweep's report is kept
    assert kept["chosen"] is None and kept["tasks"]["vqa"]["certificate"]["tested_samples"] == 6
    err = printed.err.strip().splitlines()
    assert err[-1].startswith("hf-earlyexit: error: No setting is certified") and err[-1].endswith("nothing written.")
    assert not any(line.startswith("No setting") for line in err)  # said once, as the error
    assert main([*argv, "--risk", "1.5"]) == 2 and "must lie in (0, 1)" in capsys.readouterr().err
    assert main([*argv, "--risk", "caption=0.1"]) == 2 and "for ['caption'], which are not" in capsys.readouterr().err
    assert main([*argv, "--risk", "vqa=0.1,vqa=0.5"]) == 2 and "['vqa'] more than one" in capsys.readouterr().err
    assert main([*argv, "--risk", "0.1,0.2"]) == 2 and "one per task" in capsys.readouterr().err
    assert main([*argv, *grid, "--risk", "vqa=0.5", "--delta", "0.2", "--json"]) == 0  # a level per task
    assert json.loads(capsys.readouterr().out)["tasks"]["vqa"]["certificate"]["risk_level"] == 0.5


def test_calibrate_times_the_drafts_of_speculative_mode(task_model_dir, capsys, monkeypatch):
    """On the device generate would run on (Accelerate's: the GPU when there is one), which the report names."""
    from hf_earlyexit import sharding

    devices = []
    monkeypatch.setattr(sharding, "process_device", lambda: devices.append("asked") or torch.device("cpu"))
    argv = ["calibrate", str(task_model_dir), "--tasks", "caption", "--samples", "2", "--exit-mode", "speculative"]
    thresholds = ["--confidence-thresholds", "", "--draft-layers", "1", "--draft-tokens", "2,3"]
    assert main([*argv, *thresholds, "--repeats", "1", "--quiet", "--json", "--draft-batch-sizes", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_mode"] == "speculative" and report["batch_size"] == 1 and report["points"] == 4
    assert devices and report["device"] == device_name(torch.device("cpu")) and report["dtype"] == "float32"
    points = report["tasks"]["caption"]["points"]
    drafts = {(point["settings"]["draft_exit_policy"], point["settings"]["draft_exit_threshold"]) for point in points}
    assert drafts == {("fixed_layer", 1)}  # a layer, not a score; no similarity drafts unless asked
    assert {point["settings"]["num_assistant_tokens"] for point in points} == {2, 3}
    assert {point["settings"]["num_assistant_tokens_schedule"] for point in points} == {"constant", "heuristic"}
    assert all(point["same_outputs_as_full"] for point in points)
    if report["chosen"] is not None:  # the clock decides; then the choice was timed at batch 2 as well
        assert report["batch_sizes"]["2"]["caption"]["same_outputs_as_full"]
        assert report["chosen"]["draft_max_batch_size"] == report["draft_max_batch_size"] in (1, 2)


@pytest.mark.parametrize("drafts_speedup", [20.0, 0.05])
def test_calibrate_drafts_writes_a_choice_whole_or_reports_why_it_wrote_none(
    task_model_dir, capsys, monkeypatch, drafts_speedup
):
    """The clock is faked (the drafts timed `drafts_speedup` x as fast as the full model); the decoding is real. A
    choice timed at one batch size drafts up to that size, whatever bound an earlier calibration saved; with nothing
    chosen the timings are printed before the error. Task names may carry spaces."""
    from hf_earlyexit import draft_calibration

    timed = draft_calibration.paired_seconds

    def faked(*args, **kwargs) -> dict[str, float]:
        seconds = timed(*args, **kwargs)
        return {name: value if name == "full" else value / drafts_speedup for name, value in seconds.items()}

    monkeypatch.setattr(draft_calibration, "paired_seconds", faked)
    saved = GenerationConfig.from_pretrained(task_model_dir)
    saved.draft_max_batch_size = 8  # an earlier calibration's bound, for other drafts
    saved.save_pretrained(task_model_dir)
    argv = ["calibrate", str(task_model_dir), "--exit-mode", "speculative", "--tasks", "vqa, caption", "--samples", "2",
            "--confidence-thresholds", "0.0", "--draft-layers", "", "--draft-tokens", "2", "--repeats", "1",
            "--draft-schedules", "heuristic", "--quiet", "--json", "--write",
            "--draft-vocabulary-size", "5"]  # fmt: skip
    status, captured = main(argv), capsys.readouterr()
    report = json.loads(captured.out)
    assert list(report["tasks"]) == ["vqa", "caption"]
    assert report["draft_vocabulary"]["size"] == 5 == report["draft_vocabulary"]["requested"]
    assert set(report["draft_vocabulary"]["coverage"]) == {"vqa", "caption"}
    assert "token_ids" not in report["draft_vocabulary"]  # saved, not printed
    written = json.loads((task_model_dir / "generation_config.json").read_text())
    if drafts_speedup > 1:
        assert status == 0 and report["chosen"]["draft_max_batch_size"] == 1 == written["draft_max_batch_size"]
        assert written["num_assistant_tokens_schedule"] == "heuristic"
        assert len(written["draft_vocabulary"]) == 5
        saved = json.loads((task_model_dir / "calibration_speculative.json").read_text())
        assert saved["draft_vocabulary"]["token_ids"] == written["draft_vocabulary"]
        assert saved["device"] == report["device"] and saved["dtype"] == "float32"  # the clock that chose them
    else:
        assert status == 2 and report["chosen"] is None and written["draft_max_batch_size"] == 8
        assert "draft_vocabulary" not in written
        assert captured.err.strip().endswith("nothing written.")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["caption", "{m}", "image.png", "--batch-size", "0"], "--batch-size must be positive"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--plot", "p.png"], "no meaning with --exit-mode"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-tokens", "0"], "num_assistant_tokens"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-tokens", "a"], "comma-separated integers"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-schedules", "often"], "_tokens_schedule"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-layers", "1.5"], "comma-separated layers"),
        (["calibrate", "{m}", "--draft-layers", "1"], "--draft-layers"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--repeats", "0"], "--repeats must be positive"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-batch-sizes", "1"], "above the calibration's"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--draft-batch-sizes", "8,x"], "comma-separated integers"),
        (["eval", "{m}", "--task", "vqa", "--exit-threshold", "0.9", "--draft-max-batch-size", "0"], "draft_max_batch"),
        (["eval", "{t}/nowhere", "--task", "vqa"], "not a model folder"),
        (["bench", "{m}", "--task", "vqa", "--samples", "2"], "No exit setting"),
        (["bench", "{m}", "--task", "vqa", "--samples", "2", "--kv-strategy", "copy"], "No exit setting"),
        (["eval", "{m}", "--task", "vqa", "--samples", "0"], "--samples must be positive"),
        (["calibrate", "{m}", "--tasks", "vqa", "--encoder-thresholds", "high"], "comma-separated numbers"),
        (["calibrate", "{m}", "--tasks", "vqa", "--exit-token-layers", "own,deepest"], "exit_token_layer"),
        (["calibrate", "{m}", "--tasks", "vqa", "--batch-stop-fractions", "0.5,0"], "batch_stop_fraction"),
        (["calibrate", "{m}", "--tasks", "vqa", "--max-exit-layers", "any,top"], "layers or 'any'"),
        (["calibrate", "{m}", "--tasks", "vqa", "--max-exit-layers", "9"], "max_exit_layer"),
        (["eval", "{m}", "--task", "vqa", "--exit-threshold", "0.9", "--max-exit-layer", "0"], "max_exit_layer"),
        (["eval", "{m}", "--task", "vqa", "--exit-threshold", "0.9", "--batch-stop-fraction", "2"], "batch_stop"),
        (["calibrate", "{m}", "--tasks", "ocr"], "Unknown task 'ocr'"),
        (["calibrate", "{m}", "--tasks", "vqa,foo"], "Unknown task 'foo'"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--tasks", "vqa,foo"], "Unknown task 'foo'"),
        (["bench", "--forced-exit", "1", "--batch-sizes", "a"], "--batch-sizes must be comma-separated integers"),
        (["bench", "--training-step", "--dtype", "bfloat16"], "times on the CPU in float32: drop ['--dtype']"),
        (["calibrate", "{m}", "--tasks", "vqa", "--batch-size", "0"], "--batch-size must be positive"),
        (["calibrate", "{m}", "--tasks", "vqa", "--samples", "0"], "--samples must be positive"),
        (["eval", "{m}", "--task", "vqa", "--full", "--exit-threshold", "0.5"], "--full runs the full model"),
        (["bench", "{m}", "--task", "vqa", "--full", "--exit-threshold", "0.5"], "drop --full"),
        (["calibrate", "{m}", "--tasks", "vqa", "--tolerance", "1.5"], "`tolerance` must lie in [0, 1)"),
        (["calibrate", "{m}", "--tasks", "vqa", "--risk", "vqa=0.1,captoin=0.1"], "not among the tasks"),
        ([*NO_THRESHOLDS, "--risk", "0.1"], "Nothing to sweep"),
        (["bench", "{m}", "--forced-exit", "1"], "not both"),
        *(
            [
                (
                    ["bench", "{m}", "--task", "vqa", "--exit-threshold", "0.5", "--device", "cuda"],
                    "the CPU alone (no accelerator)",
                )
            ]
            if not torch.cuda.is_available()
            else []
        ),
        (["bench"], "Give a model folder"),
        (["bench", "{m}", "--task", "vqa", "--device", "meta"], "Device meta: this machine has"),  # was a traceback
        (["demo", ""], "MODEL_DIR is empty"),  # ran the embedded model
        (["calibrate", "{m}", "--tasks", "vqa", "--risk", ""], "--risk is empty"),  # ran uncertified
        (["calibrate", "{m}", "--tasks", "vqa", "--plot", ""], "--plot is empty"),  # skipped the plot
        (["publish", "{m}", "--repo-id", "u/x", "--dry-run", "--datasets", " , "], "a blank item"),
        (["bench", "--forced-exit", "1", "--training-step"], "give one"),
        (["bench", "--training-step", "--batch-sizes", "1,8"], "one batch size"),
        (["calibrate", "{m}", "--tasks", "vqa", "--plot", "{t}/tradeoff.txt"], "name an image file"),
        (["calibrate", "{m}", "--tasks", "vqa", "--plot", "{m}/config.json/x.png"], "config.json is not a folder"),
        (["calibrate", "{m}", "--tasks", "vqa", "--plot", "{m}"], "name an image file"),
        (["bench", "{m}", "--task", "vqa", "--batch-sizes", "8"], "['--batch-sizes'] set up --forced-exit"),
        (["bench", "{m}", "--task", "vqa", "--preset", "tiny"], "['--preset'] set up --forced-exit"),
        (["bench", "--forced-exit", "1", "--row-exit", "keep"], "['--row-exit'] have no meaning with --forced-exit"),
        (["bench", "--forced-exit", "1", "--task", "vqa", "--samples", "0"], "['--task', '--samples'] have no"),
        (["bench", "--forced-exit", "1", "--exit-losses", "none"], "['--exit-losses'] have no meaning"),
        (["bench", "--training-step", "--encoder-batch-size", "2"], "['--encoder-batch-size'] have no meaning"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--risk", "0.1"], "['--risk'] have no meaning"),
        (["calibrate", "{m}", "--exit-mode", "speculative", "--max-exit-layers", "1"], "['--max-exit-layers'] have"),
        (["calibrate", "{m}", "--tasks", "vqa", "--draft-tokens", "8"], "['--draft-tokens'] time speculative"),
        (["calibrate", "{m}", "--tasks", "vqa", "--draft-vocabulary-size", "9"], "['--draft-vocabulary-size'] time"),
        (["calibrate", "{m}", "--tasks", "vqa", "--risk", "0.1", "--tolerance", "0.5"], "give one of them"),
        (["calibrate", "{m}", "--tasks", "vqa", "--risk", "0.1", "--tolerance", "0.01"], "give one of them"),
        (["calibrate", "{m}", "--tasks", "vqa", "--delta", "0.5"], "--delta is the error level of --risk's"),
        (["eval", "{m}", "--task", "vqa", "--meteor"], "--meteor scores captions; --task vqa has none"),
        (["bench", "{m}", "--task", "vqa", "--meteor"], "--meteor scores captions"),
        (["eval", "{m}", "--task", "vqa", "--exit-threshold", "0.5", "--draft-exit-threshold", "0.3"], "lossy exits"),
        (["demo", "{m}", "--output-dir", "{m}/config.json"], "--output-dir {m}/config.json/caption_exits.png"),
        (["caption", "{t}/weights_cut", "{t}/ok.png"], "not a readable safetensors file"),
        (["eval", "{t}/deeper", "--task", "vqa"], "the weights do not fit config.json ("),
        (["convert", "--from", "{t}/list.pt", "--to", "{t}/converted"], "holds a list, not a checkpoint"),
        (["convert", "--from", "{m}", "--to", "{t}/converted"], "is an hf-earlyexit model already"),
    ],
)
def test_task_command_errors_are_one_line(task_model_dir, tmp_path, capsys, argv, message):
    import shutil

    shutil.copytree(task_model_dir, tmp_path / "weights_cut")
    weights = tmp_path / "weights_cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    shutil.copytree(task_model_dir, tmp_path / "deeper")  # a config.json edited apart from its weights
    config = json.loads((tmp_path / "deeper" / "config.json").read_text())
    (tmp_path / "deeper" / "config.json").write_text(json.dumps({**config, "decoder_layers": 5}))
    torch.save([1, 2], tmp_path / "list.pt")
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    argv = [arg.format(t=tmp_path, m=task_model_dir) for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-earlyexit: error: ") and message.format(m=task_model_dir) in err
    assert len(err.strip().splitlines()) == 1


def test_an_error_of_several_lines_is_printed_as_one_and_an_interrupt_says_how_to_go_on(capsys, monkeypatch, tmp_path):
    from hf_earlyexit import cli

    def fails(args):
        raise ValueError("first line\n  second line")

    def interrupted(args):
        raise KeyboardInterrupt

    for run, status, said in (
        (fails, 2, "hf-earlyexit: error: first line second line\n"),
        (interrupted, 130, "hf-earlyexit: interrupted\n"),  # nothing to resume (it said --resume to every command)
    ):
        monkeypatch.setattr(cli, "cmd_caption", run)
        assert main(["caption", "model", "image.png"]) == status
        assert capsys.readouterr().err.endswith(said)
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-5" / "trainer_state.json").write_text("{}")  # a complete checkpoint
    monkeypatch.setattr(cli, "cmd_train", interrupted)
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 130
    assert "interrupted (continue with --resume)" in capsys.readouterr().err


def test_running_out_of_memory_is_one_line_below_the_progress_bar(capsys, monkeypatch):
    """Sizes past the machine's memory ended in the allocator's traceback, printed on the open progress bar's line."""
    from tqdm.auto import tqdm

    from hf_earlyexit import cli

    def allocates(args):
        tqdm(total=3, desc="timing").update()  # a bar left open, as a failing stage leaves it
        torch.empty(1 << 60, dtype=torch.uint8)

    for failure, said in ((allocates, "out of memory"), (lambda args: 1 / 0, None)):
        monkeypatch.setattr(cli, "cmd_caption", failure)
        if said is None:  # other errors stay tracebacks: they are bugs to report
            with pytest.raises(ZeroDivisionError):
                main(["caption", "model", "image.png"])
            continue
        assert main(["caption", "model", "image.png"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith(f"hf-earlyexit: error: {said} (") and err.endswith("batches\n")


def test_demo_uses_the_embedded_model_and_shows_exit_layers_and_savings(tmp_path, capsys):
    assert main(["demo", "--output-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "embedded_model with AutoModel/AutoProcessor (trust_remote_code=True)" in out
    for task in ("vqa", "entailment", "caption"):
        assert f"  {task} " in out
    assert "expected time reduction" in out and "% of full" in out
    assert "speculative (lossless): the full model's outputs" in out
    assert "[caption] what does the image describe? -> " in out and ("(1)" in out or "(2)" in out)
    assert (tmp_path / "demo" / "caption_exits.png").stat().st_size > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["caption", "m", "image.png", "--num-beams", "-1"],
        ["caption", "m", "image.png", "--num-beams", "0"],
        ["caption", "m", "image.png", "--max-new-tokens", "0"],
        ["train", "--max-steps", "0"],
        ["bench", "--forced-exit", "1", "--image-size", "0"],
        ["bench", "--forced-exit", "1", "--encoder-batch-size", "0"],
        ["demo", "--batch-size", "0"],  # before the model loads
        ["calibrate", "m", "--exit-mode", "speculative", "--draft-vocabulary-size", "0"],
    ],
)
def test_counts_below_one_are_refused_before_anything_runs(capsys, argv):
    with pytest.raises(SystemExit) as exit_status:
        main(argv)
    assert exit_status.value.code == 2
    err = capsys.readouterr().err  # one line, as every other error
    assert err.startswith("hf-earlyexit: error: ") and len(err.strip().splitlines()) == 1
    assert f"argument {argv[-2]}: must be a positive integer, got '{argv[-1]}'" in err


def test_argparse_errors_name_the_command_once(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--forced-exit", "1", "--quiet"])  # reported by the top-level parser
    assert capsys.readouterr().err == (
        "hf-earlyexit: error: unrecognized arguments: --quiet (see hf-earlyexit --help)\n"
    )
    with pytest.raises(SystemExit):
        main(["bench", "--task", "poems"])  # reported by the subcommand's parser
    assert capsys.readouterr().err.startswith("hf-earlyexit: error: bench: argument --task: invalid choice")


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--exit-threshold", "abc", "expected a number or 'none', got 'abc'"),
        ("--draft-exit-threshold", "high", "expected a number or 'none', got 'high'"),
        ("--draft-max-batch-size", "x", "expected an integer or 'none', got 'x'"),
        ("--max-exit-layer", "top", "expected an integer or 'none', got 'top'"),
    ],
)
def test_knob_values_that_are_no_number_or_none_are_refused_by_name(capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_status:
        main(["eval", "some/model", option, value])
    assert exit_status.value.code == 2
    assert f"argument {option}: {expected}" in capsys.readouterr().err


def test_none_gives_the_draft_threshold_none_whatever_the_saved_default():
    from hf_earlyexit.cli import build_parser, given_knobs

    args = build_parser().parse_args(["eval", "some/model", "--task", "caption", "--draft-exit-threshold", "none"])
    assert given_knobs(args) == {"draft_exit_threshold": None}
    args = build_parser().parse_args(["eval", "some/model", "--task", "caption", "--max-exit-layer", "none"])
    assert given_knobs(args) == {"max_exit_layer": None}  # a saved `max_exit_layer` lifted, the other exits kept
