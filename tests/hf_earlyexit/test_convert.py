"""Conversion of official OFA checkpoints (HF port folder and fairseq .pt)."""

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from hf_earlyexit.convert import FAIRSEQ_RENAMES, convert_checkpoint, rename_fairseq_key
from tests.modeling.test_modeling_ofa import official_image_buckets, official_token_buckets

# fairseq's names for our layer parts (the inverse of the official renames).
TO_FAIRSEQ = {
    "encoder": (("self_attn_mid_layer_norm", "attn_ln"), ("ffn_layer_norm", "ffn_layernorm")),
    "decoder": (
        ("self_attn_mid_layer_norm", "self_attn_ln"),
        ("cross_attn_mid_layer_norm", "cross_attn_ln"),
        ("cross_attn.", "encoder_attn."),
        ("cross_attn_layer_norm", "encoder_attn_layer_norm"),
        ("ffn_layer_norm", "ffn_layernorm"),
    ),
}


def fairseq_key(key: str) -> str:
    for ours, theirs in TO_FAIRSEQ[key.split(".")[0]]:
        key = key.replace(ours, theirs)
    return key


def reference_logits(model, fixture) -> torch.Tensor:
    io = load_file(fixture / "io.safetensors")
    with torch.no_grad():
        logits = model(
            input_ids=io["input_ids"], pixel_values=io["patch_images"], decoder_input_ids=io["decoder_input_ids"]
        ).logits
    return logits, io["logits"]


def copy_port_checkpoint(fixture, folder, state_dict=None):
    folder.mkdir()
    shutil.copy(fixture / "config.json", folder / "config.json")
    save_file(
        state_dict if state_dict is not None else load_file(fixture / "model.safetensors"), folder / "model.safetensors"
    )
    return folder


def test_converts_the_port_checkpoint_and_reloads_with_official_outputs(reference_fixture, tmp_path):
    convert_checkpoint(reference_fixture, tmp_path / "converted")
    model = AutoModel.from_pretrained(tmp_path / "converted", trust_remote_code=True)
    logits, official = reference_logits(model, reference_fixture)
    torch.testing.assert_close(logits, official, atol=1e-4, rtol=1e-4)
    saved = load_file(tmp_path / "converted" / "model.safetensors")
    assert not any("rp_bucket" in key or "version" in key for key in saved)


def test_index_buffers_and_version_keys_are_accepted_and_dropped(reference_fixture, tmp_path):
    state_dict = load_file(reference_fixture / "model.safetensors")
    # [0] + 256 code-window ids + [1024] * 768, as the port stores it (its values never matter here).
    image_position_idx = torch.cat([torch.tensor([0]), torch.arange(256) + 1, torch.full((768,), 1024)])
    state_dict.update(
        {
            "encoder.token_rp_bucket": official_token_buckets(256, 1024),
            "decoder.token_rp_bucket": official_token_buckets(256, 1024),
            "encoder.image_rp_bucket": official_image_buckets(42),
            "decoder.image_rp_bucket": official_image_buckets(42),
            "decoder.image_position_idx": image_position_idx,
            "encoder.version": torch.tensor([3.0]),
            "decoder.version": torch.tensor([3.0]),
        }
    )
    source = copy_port_checkpoint(reference_fixture, tmp_path / "with_buffers", state_dict)
    model = convert_checkpoint(source, tmp_path / "converted")
    logits, official = reference_logits(model, reference_fixture)
    torch.testing.assert_close(logits, official, atol=1e-4, rtol=1e-4)


def test_a_renamed_or_missing_key_is_an_error_that_lists_it(reference_fixture, tmp_path):
    state_dict = load_file(reference_fixture / "model.safetensors")
    state_dict["encoder.layers.1.fc1.weight_renamed"] = state_dict.pop("encoder.layers.1.fc1.weight")
    source = copy_port_checkpoint(reference_fixture, tmp_path / "renamed", state_dict)
    with pytest.raises(ValueError, match=r"Missing keys: \['encoder.layers.1.fc1.weight'\].*fc1.weight_renamed"):
        convert_checkpoint(source, tmp_path / "out")
    state_dict["encoder.layers.0.fc1.weight_renamed"] = state_dict.pop("encoder.layers.0.fc1.weight")
    source = copy_port_checkpoint(reference_fixture, tmp_path / "renamed_first", state_dict)
    with pytest.raises(ValueError, match="lacks 'encoder.layers.0.fc1.weight'"):
        convert_checkpoint(source, tmp_path / "out")

    state_dict = load_file(reference_fixture / "model.safetensors")
    del state_dict["decoder.layers.1.cross_attn.c_attn"]
    source = copy_port_checkpoint(reference_fixture, tmp_path / "missing", state_dict)
    with pytest.raises(ValueError, match=r"Missing keys: \['decoder.layers.1.cross_attn.c_attn'\]"):
        convert_checkpoint(source, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_converting_never_writes_over_earlier_work(reference_fixture, tmp_path):
    source = copy_port_checkpoint(reference_fixture, tmp_path / "port")
    before = {path.name: path.read_bytes() for path in source.iterdir()}
    with pytest.raises(ValueError, match="into itself would overwrite the checkpoint"):
        convert_checkpoint(source, source)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")  # e.g. another model's files
    (tmp_path / "a_file").write_text("")
    for target in ("model", "a_file"):
        with pytest.raises(ValueError, match="already holds files: convert into a new or empty folder"):
            convert_checkpoint(source, tmp_path / target)
    assert {path.name: path.read_bytes() for path in source.iterdir()} == before
    assert [path.name for path in (tmp_path / "model").iterdir()] == ["tokenizer.json"]
    (tmp_path / "empty").mkdir()
    convert_checkpoint(source, tmp_path / "empty")  # an empty folder is a new one
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_config_that_disagrees_with_the_weights_is_an_error(reference_fixture, tmp_path):
    source = copy_port_checkpoint(reference_fixture, tmp_path / "port")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "encoder_layers": 6, "mystery_field": 1}))
    with pytest.raises(ValueError, match="mystery_field"):
        convert_checkpoint(source, tmp_path / "out")
    (source / "config.json").write_text(json.dumps({**config, "encoder_layers": 6}))
    with pytest.raises(ValueError, match="encoder_layers: config 6 vs weights 2"):
        convert_checkpoint(source, tmp_path / "out")


def test_fairseq_checkpoint_converts_to_the_same_model(reference_fixture, tmp_path):
    weights = {fairseq_key(key): value for key, value in load_file(reference_fixture / "model.safetensors").items()}
    assert "encoder.layers.0.attn_ln.weight" in weights and "decoder.layers.0.encoder_attn.k_proj.weight" in weights
    weights["encoder.version"] = torch.tensor([3.0])
    torch.save({"model": weights, "args": argparse.Namespace(arch="ofa_tiny")}, tmp_path / "checkpoint.pt")
    model = convert_checkpoint(tmp_path / "checkpoint.pt", tmp_path / "converted")
    logits, official = reference_logits(model, reference_fixture)
    torch.testing.assert_close(logits, official, atol=1e-4, rtol=1e-4)


def test_fairseq_renames_apply_in_order():
    assert FAIRSEQ_RENAMES[-1][0] == "attn_ln"
    assert (
        rename_fairseq_key("decoder.layers.3.self_attn_ln.weight") == "decoder.layers.3.self_attn_mid_layer_norm.weight"
    )
    assert rename_fairseq_key("encoder.layers.3.attn_ln.bias") == "encoder.layers.3.self_attn_mid_layer_norm.bias"
    assert rename_fairseq_key("decoder.layers.0.encoder_attn_layer_norm.weight") == (
        "decoder.layers.0.cross_attn_layer_norm.weight"
    )


def test_pickle_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"model": {}, "trainer": object()}, tmp_path / "unsafe.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        convert_checkpoint(tmp_path / "unsafe.pt", tmp_path / "out")


def test_missing_source_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="No checkpoint"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "out")


def test_port_pytorch_model_bin_is_read_with_weights_only(reference_fixture, tmp_path):
    source = tmp_path / "port_bin"
    source.mkdir()
    shutil.copy(reference_fixture / "config.json", source / "config.json")
    torch.save(load_file(reference_fixture / "model.safetensors"), source / "pytorch_model.bin")
    model = convert_checkpoint(source, tmp_path / "converted")
    logits, official = reference_logits(model, reference_fixture)
    torch.testing.assert_close(logits, official, atol=1e-4, rtol=1e-4)
