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
