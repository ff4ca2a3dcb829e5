"""Publishing: the assembled folder (files, auto_map, generation defaults), the card (metadata, measured table),
the validation in a process without hf_earlyexit, the upload through a patched huggingface_hub, and each error."""

import json
import os
import shutil
from unittest import mock

import pytest
from huggingface_hub import ModelCard
from PIL import Image

import hf_earlyexit
from hf_earlyexit import publishing
from hf_earlyexit.calibration import write_generation_defaults
from hf_earlyexit.cli import main
from hf_earlyexit.loading import weights_fingerprint
from hf_earlyexit.model_cards import guarantee, measured_table, read_benchmark, render_model_card
from hf_earlyexit.publishing import PublishError, assemble, publish, validate_folder
from hf_earlyexit.training import small_model_and_processor

REPO_ID = "someone/ofa-ee-tiny"
KNOBS = {"exit_threshold": 0.9, "exit_policy": "confidence", "encoder_image_exit_threshold": 0.95}
# The shape `hf-earlyexit bench MODEL_DIR --json` prints (tests/hf_earlyexit/test_benchmark.py checks that shape).
RECORD = {
    "task": "vqa",
    "metric": "accuracy",
    "samples": 200,
    "batch_size": 1,
    "device": "cpu (2 threads)",
    "full": {"quality": 0.8, "seconds": 2.0},
    "early_exit": {
        "quality": 0.796,
        "seconds": 1.2,
        "expected_time_reduction": 0.4321,
        "expected_time_reduction_flops": 0.6012,
        "settings": KNOBS,
    },
    "quality_ratio": 0.995,
    "wall_clock_time_reduction": 0.3912,
}
# What `calibrate --risk 0.02 --write` saves (tests/hf_earlyexit/test_calibration.py checks that shape).
CERTIFICATE = {"loss": "binary", "risk_level": 0.02, "delta": 0.1, "ordering_samples": 975, "tested_samples": 2924,
               "certified_settings": 9, "settings": KNOBS, "p_value": 3.1e-6, "empirical_risk": 0.0041}  # fmt: skip
CALIBRATION = {"split": "validation", "risk_level": {"vqa": 0.02}, "delta": 0.1, "chosen": KNOBS,
               "tasks": {"vqa": {"certificate": CERTIFICATE}}}  # fmt: skip
CODE_FILES = {
    "configuration_ofa.py",
    "modeling_ofa.py",
    "exit_controllers.py",
    "early_exit_cache.py",
    "exit_knobs.py",
    "generation_early_exit.py",
    "processing_ofa.py",
    "row_exits.py",
    "speculative.py",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small trained-format model folder: weights, processor, calibrated defaults, a recipe and a benchmark."""
    folder = tmp_path_factory.mktemp("model")
    texts = ["a red circle left of a blue square", " what does the image describe?", "yes", "no"] * 20
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=3, encoder_ffn_dim=64, decoder_ffn_dim=64)
    model, processor = small_model_and_processor(texts, vocab_size=300, decompose_encoder_modalities=True, **sizes)
    write_generation_defaults(model, KNOBS)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "benchmark.jsonl").write_text(json.dumps(RECORD) + "\n")
    (folder / "calibration.json").write_text(json.dumps(CALIBRATION))
    recipe = {"script": "train.py", "options": {"max_steps": 7}, "data": {"dataset": "json:/home/someone/data"}}
    (folder / "training_recipe.json").write_text(json.dumps(recipe))
    return folder


@pytest.fixture(scope="module")
def assembled(model_dir, tmp_path_factory):
    return assemble(model_dir, tmp_path_factory.mktemp("hub") / "ofa-ee-tiny", REPO_ID, datasets=["easy-vqa"])


def test_folder_has_weights_code_processor_and_auto_maps(assembled):
    names = {path.name for path in assembled.iterdir()}
    assert names == CODE_FILES | {
        "README.md",
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "benchmark.jsonl",
        "training_recipe.json",
        "calibration.json",
        publishing.ASSEMBLY_MANIFEST,  # what it wrote, so that a later run replaces only that; not uploaded
    }
    config = json.loads((assembled / "config.json").read_text())
    model_class = "modeling_ofa.EarlyExitOFAForConditionalGeneration"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_ofa.OFAEarlyExitConfig",
        **dict.fromkeys(("AutoModel", "AutoModelForSeq2SeqLM", "AutoModelForImageTextToText"), model_class),
    }
    processor_config = json.loads((assembled / "processor_config.json").read_text())
    assert processor_config["auto_map"]["AutoProcessor"] == "processing_ofa.OFAProcessor"
    assert processor_config["image_processor"]["auto_map"]["AutoImageProcessor"] == "processing_ofa.OFAImageProcessor"
    # The recipe goes up without its data block, which names the training machine's folders.
    assert json.loads((assembled / "training_recipe.json").read_text()) == {
        "script": "train.py",
        "options": {"max_steps": 7},
    }
    generation = json.loads((assembled / "generation_config.json").read_text())
    assert {name: generation[name] for name in KNOBS} == KNOBS
    assert read_benchmark(assembled / "benchmark.jsonl") == [RECORD]
    # Every file readable as the user's umask makes files (Transformers wrote the weights as 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert {path.stat().st_mode & 0o777 for path in assembled.iterdir()} == {0o666 & ~umask}


def test_measured_table_names_each_records_kv_strategy_and_the_settings_that_differ():
    copied = {**RECORD, "early_exit": {**RECORD["early_exit"], "settings": {**KNOBS, "kv_strategy": "copy"}}}
    rows = measured_table([RECORD, copied]).splitlines()[2:]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["propagate", "copy"]
    bounded = {**RECORD, "early_exit": {**RECORD["early_exit"], "settings": {**KNOBS, "max_exit_layer": 1}}}
    rows = measured_table([RECORD, bounded]).splitlines()[2:]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == [
        "propagate; max_exit_layer=None",
        "propagate; max_exit_layer=1",
    ]


def test_a_record_measured_with_other_settings_than_the_saved_defaults_says_so():
    """After `calibrate --write`, an earlier benchmark no longer measures what the card calls the model's defaults."""
    rows = measured_table([RECORD], KNOBS).splitlines()[2:]
    assert rows[0].endswith("| propagate |")
    recalibrated = {**KNOBS, "exit_threshold": 0.6}
    rows = measured_table([RECORD], recalibrated).splitlines()[2:]
    assert rows[0].endswith("| propagate; exit_threshold=0.9 (not the saved defaults) |")
    copied = {**RECORD, "early_exit": {**RECORD["early_exit"], "settings": {**KNOBS, "kv_strategy": "copy"}}}
    rows = measured_table([RECORD, copied], KNOBS).splitlines()[2:]  # the copy row was shown as the defaults'
    assert rows[0].endswith("| propagate |") and rows[1].endswith("| copy (not the saved defaults) |")


def test_a_draft_vocabulary_is_counted_in_the_card_and_never_marks_a_lossy_record_stale():
    drafting = {**KNOBS, "draft_vocabulary": list(range(3, 403))}
    rows = measured_table([RECORD], drafting).splitlines()[2:]
    assert rows[0].endswith("| propagate |")  # lossy exits never read it
    card = render_model_card(REPO_ID, {}, drafting, "")
    assert '"draft_vocabulary": "400 token ids"' in card and "402" not in card


def test_a_record_without_a_quality_shows_a_dash_not_a_crash():
    unscored = {
        **RECORD,
        "full": {**RECORD["full"], "quality": None},
        "early_exit": {**RECORD["early_exit"], "quality": None},
    }
    row = measured_table([unscored]).splitlines()[2]
    assert row.startswith("| vqa | accuracy | — | — | — |")
    # A full model that scored 0 (a model that cannot do the task yet) has no ratio: it showed "nan%".
    zero = {
        **RECORD,
        "full": {**RECORD["full"], "quality": 0.0},
        "early_exit": {**RECORD["early_exit"], "quality": 0.0},
    }
    assert measured_table([zero]).splitlines()[2].startswith("| vqa | accuracy | 0.000 | 0.000 | — |")


def test_a_plot_that_is_not_a_png_is_refused_before_anything_is_written(model_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match="not a PNG"):
        assemble(model_dir, tmp_path / "out", REPO_ID, plot=tmp_path / "notes.txt")
    assert not (tmp_path / "out").exists()


def test_card_metadata_parses_and_holds_the_measured_table(assembled):
    card = ModelCard.load(assembled / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "image-text-to-text"  # the pipeline it loads in (Transformers 5)
    assert card.data.datasets == ["easy-vqa"]
    assert {"early-exit", "custom_code"} <= set(card.data.tags)
    assert (
        "| vqa | accuracy | 0.800 | 0.796 | 99.5% | 43.2% / 60.1% | 39.1% | 200 x 1 | cpu (2 threads) | propagate |"
        in card.text
    )
    assert f'AutoModel.from_pretrained("{REPO_ID}", trust_remote_code=True)' in card.text
    # The card's full-model call turns off every encoder exit a model may save (a joint encoder's too).
    assert all(f"{part}_exit_threshold=None" in card.text for part in ("encoder", "encoder_image", "encoder_text"))
    assert json.dumps(KNOBS) in card.text  # the calibrated defaults
    assert "`max_steps`: 7" in card.text  # the recipe
    assert "2 encoder and 3 decoder layers, d_model 32" in card.text
    assert "for each task, with probability at least 90% over its calibration samples" in card.text
    assert "| vqa | answer differs | 2.0% | 2924 | 0.41% | 3.1e-06 |" in card.text


def test_a_card_says_when_the_defaults_are_not_certified():
    assert "none beyond the calibration split" in guarantee({"chosen": KNOBS, "tolerance": 0.01, "tasks": {}})
    assert "within 1.0% of the full model" in guarantee({"chosen": KNOBS, "tolerance": 0.01, "tasks": {}})
    assert guarantee(None).startswith("Guarantee: none recorded")


def test_the_shipped_models_records_are_refused_for_other_weights(model_dir, tmp_path):
    """They carried no fingerprint, so a fine-tuned model was published with the embedded model's numbers."""
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR

    shipped = weights_fingerprint(EMBEDDED_MODEL_DIR)
    for name in ("calibration.json", "calibration_speculative.json"):
        assert json.loads((EMBEDDED_MODEL_DIR / name).read_text())["weights"] == shipped
    assert {record["weights"] for record in read_benchmark(EMBEDDED_MODEL_DIR / "benchmark.jsonl")} == {shipped}
    with pytest.raises(ValueError, match=r"benchmark.jsonl, line 1: measured on other weights"):
        assemble(model_dir, tmp_path / "out", REPO_ID, benchmark=[EMBEDDED_MODEL_DIR / "benchmark.jsonl"])


def test_a_card_speaks_of_streams_only_for_a_decomposed_encoder():
    """Every card spoke of image and text streams, which a joint encoder does not have."""
    joint = render_model_card(REPO_ID, {"decompose_encoder_modalities": False}, {}, "")
    assert "stream" not in joint and "The encoder (image and text together) can stop" in joint
    decomposed = render_model_card(REPO_ID, {"decompose_encoder_modalities": True}, {}, "")
    assert "separate streams" in decomposed and "the image and the text stream exited after" in decomposed


def test_validation_loads_without_the_package_and_generates_with_and_without_exits(assembled):
    report = validate_folder(assembled)
    assert report["hf_earlyexit_imported"] is False
    assert report["module"].startswith("transformers_modules")
    assert {layer for row in report["full"]["exit_layers"] for layer in row} <= {0, 3}
    assert {layer for row in report["first_exit"]["exit_layers"] for layer in row} <= {0, 1}
    assert report["defaults"]["encoder_exit_layers"]  # the calibrated defaults ran


def test_validation_forces_the_first_exit_point_of_blipee_exit_layers(tmp_path):
    """BLIPEE's tokens exit only at its exit layers: the forced run exits at the first, not at layer 1."""
    texts = ["a red circle left of a blue square", " what does the image describe?"] * 20
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=3, encoder_ffn_dim=64, decoder_ffn_dim=64)
    model, processor = small_model_and_processor(texts, vocab_size=300, exit_transformer_layers=[2], **sizes)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    report = validate_folder(tmp_path)  # was "tokens forced to exit after layer 1 ran deeper"
    assert {layer for row in report["first_exit"]["exit_layers"] for layer in row} <= {0, 2}


def test_validation_refuses_a_folder_whose_code_does_not_load(assembled, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in assembled.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "exit_controllers.py").write_text("raise ImportError('half-copied folder')\n")
    with pytest.raises(ValueError, match="does not load and generate without hf_earlyexit: .*half-copied folder"):
        validate_folder(broken)


def test_publish_creates_the_repo_and_uploads_the_validated_folder(model_dir, tmp_path):
    with mock.patch("huggingface_hub.HfApi") as api_class:
        api = api_class.return_value
        api.create_repo.return_value = f"https://huggingface.co/{REPO_ID}"
        published = hf_earlyexit.publish(model_dir, REPO_ID, private=True, output_dir=tmp_path / "out", token="hf_test")
    api_class.assert_called_once_with(token="hf_test")
    api.create_repo.assert_called_once_with(REPO_ID, private=True, exist_ok=True, repo_type="model")
    api.upload_folder.assert_called_once_with(
        repo_id=REPO_ID,
        folder_path=tmp_path / "out",
        commit_message="Upload OFA-EE model with hf-earlyexit",
        repo_type="model",
        ignore_patterns=[publishing.ASSEMBLY_MANIFEST],
    )
    assert published.url == f"https://huggingface.co/{REPO_ID}"
    assert published.validation["hf_earlyexit_imported"] is False


@pytest.fixture
def no_validation(monkeypatch):
    """The error tests below stop before or after validation, which the tests above cover."""
    monkeypatch.setattr(publishing, "validate_folder", lambda folder: {})


def test_network_failure_keeps_the_folder_and_says_where(model_dir, tmp_path, no_validation):
    with mock.patch("huggingface_hub.HfApi") as api_class:
        api_class.return_value.create_repo.side_effect = ConnectionError("Name or service not known")
        with pytest.raises(PublishError, match=f"Name or service not known.*kept at {tmp_path / 'out'}"):
            publish(model_dir, REPO_ID, output_dir=tmp_path / "out", token="hf_test")
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_no_token_is_an_error_before_anything_is_written(model_dir, tmp_path, monkeypatch, no_validation):
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ValueError, match="No Hugging Face token"):
        publish(model_dir, REPO_ID, output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert publish(model_dir, REPO_ID, output_dir=tmp_path / "out", dry_run=True).url is None  # no token needed


@pytest.mark.parametrize(
    "repo_id, make_dir, match",
    [
        ("someone/bad name!", None, "Invalid repo id"),
        (REPO_ID, "no_config", "not a model folder"),
        (REPO_ID, "other_model", "not an hf-earlyexit model"),
        (REPO_ID, "no_benchmark", "needs measured numbers"),
    ],
)
def test_bad_input_is_a_clear_error(model_dir, tmp_path, no_validation, repo_id, make_dir, match):
    source = model_dir
    if make_dir:
        source = tmp_path / make_dir
        source.mkdir()
        if make_dir != "no_config":
            for path in model_dir.iterdir():
                if path.name != "benchmark.jsonl":
                    (source / path.name).write_bytes(path.read_bytes())
        if make_dir == "other_model":
            config = json.loads((source / "config.json").read_text())
            (source / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    with pytest.raises(ValueError, match=match):
        publish(source, repo_id, output_dir=tmp_path / "out", dry_run=True)


def test_a_benchmark_file_that_is_not_there_is_named(model_dir, tmp_path, no_validation):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError, match=f"No benchmark file at {missing}"):
        publish(model_dir, REPO_ID, output_dir=tmp_path / "out", dry_run=True, benchmark=[missing])
    assert not (tmp_path / "out").exists()


def test_a_previous_assembly_is_replaced_but_nothing_a_user_put_beside_it(model_dir, tmp_path, no_validation):
    out = tmp_path / "out"
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True)  # replaced: a second run after a fix
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a model folder that `publish` assembled alone.*notes.txt"):
        publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    (out / "notes.txt").unlink()
    with (out / "README.md").open("a") as card:  # an edited card was replaced, the edit lost
        card.write("My own words.\n")
    with pytest.raises(ValueError, match="README.md changed since `publish` assembled it"):
        publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    assert (out / "README.md").read_text().endswith("My own words.\n")


def test_a_model_folder_without_a_processor_fails_before_an_earlier_assembly_is_removed(
    model_dir, tmp_path, no_validation
):
    out, bare = tmp_path / "out", tmp_path / "bare"
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    bare.mkdir()
    for path in model_dir.iterdir():  # the weights and records, as `convert` without `--tokenizer` leaves them
        if "token" not in path.name and "processor" not in path.name and path.name not in ("vocab.json", "merges.txt"):
            (bare / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match="no processor loads from it.*processor.save_pretrained"):
        publish(bare, REPO_ID, output_dir=out, dry_run=True)
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda folder: (folder / "calibration.json").write_text("[1, 2]"), "calibration.json holds a list"),
        (lambda folder: (folder / "training_recipe.json").write_text("{"), "training_recipe.json is not JSON"),
        (lambda folder: (folder / "benchmark.jsonl").write_text(json.dumps({**RECORD, "full": "x"}) + "\n"),
         "A benchmark record is not what `hf-earlyexit bench --json` prints"),
        # Records measured on other weights: the card showed another model's numbers and guarantees.
        (lambda folder: (folder / "benchmark.jsonl").write_text(
            "".join(json.dumps({**RECORD, "weights": w}) + "\n\n" for w in (weights_fingerprint(folder), "0" * 16))),
         r"benchmark.jsonl, line 3: measured on other weights \(fingerprint 0000000000000000\)"),
        (lambda folder: patch_json(folder / "calibration.json", weights="0" * 16),
         "calibration.json was written for other weights .* calibrate this model again"),
    ],
)  # fmt: skip
def test_bad_records_and_a_failed_validation_keep_the_earlier_assembly_and_leave_no_staging(
    model_dir, tmp_path, monkeypatch, edit, message
):
    """They were tracebacks that left a staging folder holding a whole model; a validation that failed or was
    interrupted had already replaced the earlier assembly."""
    monkeypatch.setattr(publishing, "validate_folder", lambda folder: {})
    out, folder = tmp_path / "out", tmp_path / "edited"
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    earlier = {path.name: path.read_bytes() for path in out.iterdir()}
    shutil.copytree(model_dir, folder)
    edit(folder)
    with pytest.raises(ValueError, match=message):
        publish(folder, "someone/other", output_dir=out, dry_run=True)

    def interrupted(folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(publishing, "validate_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        publish(model_dir, "someone/other", output_dir=out, dry_run=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == earlier
    assert sorted(path.name for path in tmp_path.iterdir()) == ["edited", "out"]  # no `.out.assembling`


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # A config edited apart from its weights: was published as a truncated model, validated against itself.
        (lambda folder: patch_json(folder / "config.json", decoder_layers=2), "the weights do not fit config.json"),
        (lambda folder: (folder / "model.safetensors").write_bytes(b"not safetensors"), "not a readable safetensors"),
        (lambda folder: (folder / "generation_config.json").write_text("{"), "generation_config.json is not JSON"),
        (lambda folder: patch_json(folder / "generation_config.json", exit_threshold="abc"), "exit_threshold"),
    ],
)
def test_a_folder_that_does_not_load_as_saved_is_refused_before_the_assembly(model_dir, tmp_path, edit, message):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(model_dir, folder)
    edit(folder)
    with pytest.raises(ValueError, match=message):
        publish(folder, REPO_ID, output_dir=tmp_path / "out", dry_run=True)
    assert not (tmp_path / "out").exists()


def test_publish_assembles_into_the_current_folder_and_through_a_link(model_dir, tmp_path, no_validation, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for _ in range(2):  # a first assembly, then its replacement (was "PosixPath('.') has an empty name")
        publish(model_dir, REPO_ID, output_dir=".", dry_run=True)
        assert (tmp_path / "here" / "model.safetensors").is_file()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    publish(model_dir, REPO_ID, output_dir=tmp_path / "link", dry_run=True)
    assert (tmp_path / "real" / "README.md").is_file() and (tmp_path / "link").is_symlink()
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".assembling")]


def test_an_output_folder_that_is_a_file_is_named(model_dir, tmp_path):
    (tmp_path / "out").write_text("")
    with pytest.raises(ValueError, match="The output folder .*out is a file"):  # was "[Errno 20] Not a directory"
        publish(model_dir, REPO_ID, output_dir=tmp_path / "out", dry_run=True)


def patch_json(path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_an_output_folder_holding_the_model_folder_is_refused_before_anything_is_removed(model_dir, tmp_path):
    """`publish trainout/checkpoint-2 --output-dir trainout` would have removed the checkpoint it publishes."""
    parent = tmp_path / "trainout"
    shutil.copytree(model_dir, parent / "checkpoint-2")
    for output in (parent, parent / "checkpoint-2", parent / "checkpoint-2" / "out"):
        with pytest.raises(ValueError, match="must not be, hold or lie in the model folder"):
            publish(parent / "checkpoint-2", REPO_ID, output_dir=output, dry_run=True)
    assert (parent / "checkpoint-2" / "model.safetensors").is_file()
    other_model = tmp_path / "other"
    shutil.copytree(model_dir, other_model)  # another model's folder, not an assembly: kept
    with pytest.raises(ValueError, match="no record of an assembly"):
        publish(model_dir, REPO_ID, output_dir=other_model, dry_run=True)
    assert (other_model / "model.safetensors").is_file()


def test_output_folder_holding_other_files_is_not_overwritten(model_dir, tmp_path, no_validation):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a model folder"):
        publish(model_dir, REPO_ID, output_dir=tmp_path / "out", dry_run=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_cli_dry_run_prints_the_folder_and_errors_are_one_line(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(publishing, "validate_folder", lambda folder: {})
    monkeypatch.chdir(tmp_path)
    assert main(["publish", str(model_dir), "--repo-id", REPO_ID, "--dry-run", "--license", "mit"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip().endswith("ofa-ee-tiny")
    assert [line.split()[0] for line in printed.err.splitlines()] == ["assembling", "validating:"]  # its stages
    assert ModelCard.load(tmp_path / "ofa-ee-tiny" / "README.md").data.license == "mit"

    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for argv, message in [
        (["publish", str(model_dir), "--repo-id", REPO_ID], "No Hugging Face token"),
        (["publish", str(tmp_path / "missing"), "--repo-id", REPO_ID, "--dry-run"], "not a model folder"),
        (["publish", str(model_dir), "--repo-id", "a/b/c", "--dry-run"], "Invalid repo id"),
    ]:
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
    assert os.listdir(tmp_path) == ["ofa-ee-tiny"]


def test_a_stopped_assembly_keeps_the_earlier_one_and_the_next_run_clears_it(
    model_dir, tmp_path, no_validation, monkeypatch
):
    out, plot = tmp_path / "out", tmp_path / "plot.png"
    Image.new("RGB", (4, 4)).save(plot)
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True, plot=plot)
    plot.unlink()
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C halfway: it removed the earlier assembly and left one its next run refused

    with monkeypatch.context() as patched:
        patched.setattr(publishing, "write_card", stopped)
        with pytest.raises(KeyboardInterrupt):
            publish(model_dir, REPO_ID, output_dir=out, dry_run=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    publish(model_dir, REPO_ID, output_dir=out, dry_run=True, plot=out / "tradeoff.png")  # a plot in the old one
    assert (out / "tradeoff.png").read_bytes() == before["tradeoff.png"]
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []
