"""Loading images, saved models and a converted checkpoint's processor: user errors are ValueErrors that name the
problem."""

from types import SimpleNamespace

import pytest
from PIL import Image

from hf_earlyexit.data import train_tokenizer
from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, build_processor, load_image, load_model_and_processor
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from tests.helpers import tiny_model


def test_load_image_converts_to_rgb_and_names_a_missing_or_unreadable_file(tmp_path):
    Image.new("L", (8, 6)).save(tmp_path / "grey.png")
    assert load_image(tmp_path / "grey.png").mode == "RGB"
    with pytest.raises(ValueError, match="No image at .*nowhere.png"):
        load_image(tmp_path / "nowhere.png")
    (tmp_path / "text.png").write_text("not a png")
    with pytest.raises(ValueError, match="Cannot read .*text.png as an image"):
        load_image(tmp_path / "text.png")


def test_an_image_file_reads_upright_as_a_decoded_data_set_image_does(tmp_path):
    """A phone photo stores its pixels sideways with an EXIF orientation: `datasets.Image` turns it upright; the
    `caption` command and the collator's paths read it sideways before."""
    import datasets
    import numpy as np

    from hf_earlyexit.data import ImageTextCollator

    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    pixels = np.random.default_rng(0).integers(0, 256, (20, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.jpg", exif=exif)
    decoded = datasets.Dataset.from_dict({"image": [str(tmp_path / "photo.jpg")]}).cast_column(
        "image", datasets.Image()
    )
    assert load_image(tmp_path / "photo.jpg").size == decoded[0]["image"].size == (20, 40)
    tokenizer = train_tokenizer(["a red circle", "a blue square"], vocab_size=300)
    processor = OFAProcessor(OFAImageProcessor(size={"height": 32, "width": 32}), tokenizer)
    collator = ImageTextCollator(processor, text_column=None, target_column="caption")
    rows = [{"image": image, "caption": "a red circle"} for image in (str(tmp_path / "photo.jpg"), decoded[0]["image"])]
    pixel_values = collator(rows)["pixel_values"]
    assert bool((pixel_values[0] == pixel_values[1]).all())
    with pytest.raises(ValueError, match="Column 'image', row 0: No image at .*gone.jpg"):
        collator([{"image": str(tmp_path / "gone.jpg"), "caption": "a"}])  # was a bare FileNotFoundError


def test_a_model_folder_without_a_processor_or_with_a_broken_generation_config_is_named(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no processor loads from it"):  # was Transformers' Hub advice
        load_model_and_processor(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json is not JSON"):  # was dropped with its exits
        load_model_and_processor(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors") as missing:  # the weights named, not the processor
        load_model_and_processor(tmp_path)
    assert "processor" not in str(missing.value)


def test_load_model_and_processor_applies_config_fields_and_refuses_other_folders(tmp_path):
    tokenizer = train_tokenizer(["a red circle", "a blue square"], vocab_size=300)
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(tmp_path / "model")
    model, processor = load_model_and_processor(tmp_path / "model", exit_adapter_dim=8)
    assert not model.training and model.config.exit_adapter_dim == 8
    assert len(processor.tokenizer) == len(tokenizer)
    model.save_pretrained(tmp_path / "adapted")
    with pytest.raises(ValueError, match="exit_adapter_dim=8; it cannot load as exit_adapter_dim=16"):
        load_model_and_processor(tmp_path / "adapted", exit_adapter_dim=16)  # its adapters' weights have one shape
    decomposed, _ = load_model_and_processor(tmp_path / "model", decompose_encoder_modalities=True)  # MuE's example
    assert decomposed.config.decompose_encoder_modalities  # a flag over the same weights: a joint model loads
    with pytest.raises(ValueError, match="not a model folder"):
        load_model_and_processor(tmp_path)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="not an hf-earlyexit model"):
        load_model_and_processor(tmp_path / "bert")


def test_build_processor_checks_the_vocabulary(bart_tokenizer_dir):
    config = SimpleNamespace(vocab_size=59457, max_position_embeddings=1024)
    processor = build_processor(bart_tokenizer_dir, 96, config)
    assert len(processor.tokenizer) == 59457 and processor.image_processor.size["height"] == 96
    assert len(processor(text=" long" * 2000, truncation=True)["input_ids"][0]) == 1024  # the model's positions
    with pytest.raises(ValueError, match="59457 tokens but the model's vocabulary has 1000"):
        build_processor(bart_tokenizer_dir, 96, SimpleNamespace(vocab_size=1000, max_position_embeddings=1024))


def test_the_embedded_model_folder_ships_with_the_package():
    assert (EMBEDDED_MODEL_DIR / "config.json").is_file()


def test_check_writable_names_the_option_and_the_place_before_any_work(tmp_path, monkeypatch):
    from hf_earlyexit.loading import check_writable

    check_writable(tmp_path / "new" / "deeper", "--output-dir")  # made later, in a folder this process can write
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--output-dir .*file/run: .*file is not a folder"):
        check_writable(tmp_path / "file" / "run", "--output-dir")
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only folder (root can write anywhere)
    with pytest.raises(ValueError, match=f"--write into {tmp_path}: this process cannot write into {tmp_path}"):
        check_writable(tmp_path, "--write into")


def test_weights_fingerprint_is_of_the_tensors_however_they_are_saved(tmp_path):
    """A `train` folder's `training_args.bin`, and shards, made the same weights another fingerprint, so `publish`
    refused a published folder's own records."""
    import torch

    from hf_earlyexit.loading import weights_fingerprint

    model = tiny_model()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    (tmp_path / "one" / "training_args.bin").write_bytes(b"not weights")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    fingerprint = weights_fingerprint(tmp_path / "one")
    assert fingerprint == weights_fingerprint(tmp_path / "shards") and len(fingerprint) == 16
    with torch.no_grad():
        model.get_decoder().layers[0].fc1.weight[0, 0] += 1e-3
    model.save_pretrained(tmp_path / "changed")
    assert weights_fingerprint(tmp_path / "changed") != fingerprint
    assert weights_fingerprint(tmp_path) is None  # no weights here
