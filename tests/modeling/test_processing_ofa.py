"""Tests for `modeling/processing_ofa.py`: OFA image preprocessing, tokenization and remote-code round trips."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor, add_ofa_special_tokens
from tests.helpers import shared_path

CAPTION_PROMPT = " what does the image describe?"
CAPTION_PROMPT_IDS = [0, 99, 473, 5, 2274, 6190, 116, 2]


def _require_bart_files() -> str:
    """Path of the official BART tokenizer files; skips the test when they are not available."""
    return str(shared_path("reference", "bart_tokenizer"))


def _reference_pixels(image: Image.Image, height: int = 384, width: int = 384) -> np.ndarray:
    """torchvision's Resize((H, W), BICUBIC) + ToTensor + Normalize(0.5, 0.5), written with PIL and numpy only."""
    resized = image.convert("RGB").resize((width, height), Image.BICUBIC)
    x = np.asarray(resized, dtype=np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    return x.transpose(2, 0, 1)


def _random_uint8(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _pixels(processor, images, **kwargs) -> np.ndarray:
    return processor(images, return_tensors="pt", **kwargs)["pixel_values"].numpy()


@pytest.fixture(scope="module")
def image_processor():
    return OFAImageProcessor()


@pytest.fixture(scope="module")
def tokenizer():
    return OFAProcessor.build_tokenizer(_require_bart_files())


@pytest.fixture(scope="module")
def processor(image_processor, tokenizer):
    return OFAProcessor(image_processor=image_processor, tokenizer=tokenizer)


# --------------------------------------------------------------------------------------------------------------------
# Image processor
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hw", [(50, 70), (500, 300), (384, 384)])
def test_pil_image_matches_torchvision_style_reference(image_processor, hw):
    image = Image.fromarray(_random_uint8((*hw, 3), seed=hw[0]))
    out = image_processor(image, return_tensors="pt")["pixel_values"]
    assert out.dtype == torch.float32
    assert tuple(out.shape) == (1, 3, 384, 384)
    np.testing.assert_allclose(out[0].numpy(), _reference_pixels(image), rtol=0, atol=1e-6)


def test_values_span_minus_one_to_one(image_processor):
    image = Image.fromarray(np.array([[[0, 0, 0], [255, 255, 255]]] * 8, dtype=np.uint8))
    out = _pixels(image_processor, image, size=8)
    assert out.min() == pytest.approx(-1.0) and out.max() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("size", "expected_hw"),
    [(64, (64, 64)), ({"height": 96, "width": 128}, (96, 128)), ([40, 30], (40, 30))],
)
def test_custom_size_at_call_time(image_processor, size, expected_hw):
    image = Image.fromarray(_random_uint8((33, 47, 3)))
    out = _pixels(image_processor, image, size=size)
    assert out.shape == (1, 3, *expected_hw)
    np.testing.assert_allclose(out[0], _reference_pixels(image, *expected_hw), rtol=0, atol=1e-6)


def test_custom_size_in_constructor():
    image = Image.fromarray(_random_uint8((20, 30, 3)))
    processor = OFAImageProcessor(size={"height": 256, "width": 256})
    assert processor.size.height == processor.size.width == 256
    np.testing.assert_allclose(_pixels(processor, image)[0], _reference_pixels(image, 256, 256), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_a_16_or_32_bit_image_past_8_bits_is_refused_not_clipped(image_processor, mode):
    """PIL's `convert("RGB")` would clip every value past 255 to white; a NumPy array of them is refused too."""
    values = np.linspace(0, 4000, 24 * 40).reshape(24, 40)
    image = Image.fromarray(values.astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]))
    assert image.mode == mode
    with pytest.raises(ValueError, match=f"mode '{re.escape(mode)}' image must hold values in \\[0, 255\\]"):
        image_processor(image)


def test_turning_the_rescale_off_is_refused_not_a_silent_factor_of_255(image_processor):
    """Every image becomes 8-bit for PIL's resize (floats in [0, 1] are scaled up): skipping the 1/255 after it would
    feed the model pixels up to 255 times too large."""
    with pytest.raises(ValueError, match="drop `do_rescale=False`"):
        image_processor(torch.rand(3, 8, 8), do_rescale=False)


def test_size_without_height_and_width_is_rejected(image_processor):
    with pytest.raises(ValueError, match="height.*width"):
        image_processor(Image.new("RGB", (8, 8)), size={"shortest_edge": 32})


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA", "I;16", "1", "CMYK"])
def test_non_rgb_pil_modes_are_converted_like_pil(image_processor, mode):
    rgb = Image.fromarray(_random_uint8((24, 40, 3), seed=3))
    if mode == "P":
        image = rgb.quantize(colors=16)
    elif mode == "I;16":
        image = Image.fromarray(_random_uint8((24, 40), seed=4).astype(np.uint16))
        assert image.mode == "I;16"
    else:
        image = rgb.convert(mode)
    out = _pixels(image_processor, image, size=32)
    assert out.shape == (1, 3, 32, 32)
    np.testing.assert_allclose(out[0], _reference_pixels(image, 32, 32), rtol=0, atol=1e-6)
    if mode in ("L", "LA", "I;16", "1"):
        np.testing.assert_array_equal(out[0, 0], out[0, 1])
        np.testing.assert_array_equal(out[0, 0], out[0, 2])


def test_numpy_inputs_match_pil(image_processor):
    rgb = _random_uint8((30, 20, 3), seed=5)
    rgba = np.concatenate([rgb, _random_uint8((30, 20, 1), seed=6)], axis=-1)
    gray = _random_uint8((30, 20), seed=7)

    expected_rgb = _pixels(image_processor, Image.fromarray(rgb), size=48)
    expected_rgba = _pixels(image_processor, Image.fromarray(rgba, mode="RGBA"), size=48)
    expected_gray = _pixels(image_processor, Image.fromarray(gray, mode="L"), size=48)

    np.testing.assert_array_equal(_pixels(image_processor, rgb, size=48), expected_rgb)  # HWC
    np.testing.assert_array_equal(_pixels(image_processor, rgb.transpose(2, 0, 1), size=48), expected_rgb)  # CHW
    np.testing.assert_array_equal(_pixels(image_processor, rgb / 255.0, size=48), expected_rgb)  # float [0, 1]
    np.testing.assert_array_equal(_pixels(image_processor, (rgb / 255.0).astype(np.float32), size=48), expected_rgb)
    np.testing.assert_array_equal(_pixels(image_processor, rgba, size=48), expected_rgba)  # HWx4
    np.testing.assert_array_equal(_pixels(image_processor, gray, size=48), expected_gray)  # HxW
    np.testing.assert_array_equal(_pixels(image_processor, gray[..., None], size=48), expected_gray)  # HxWx1


def test_torch_inputs_match_pil(image_processor):
    rgb = _random_uint8((30, 20, 3), seed=8)
    expected = _pixels(image_processor, Image.fromarray(rgb), size=48)
    chw = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()

    np.testing.assert_array_equal(_pixels(image_processor, chw, size=48), expected)  # CHW uint8
    np.testing.assert_array_equal(_pixels(image_processor, chw.float() / 255, size=48), expected)  # CHW float
    np.testing.assert_array_equal(_pixels(image_processor, torch.from_numpy(rgb), size=48), expected)  # HWC uint8


def test_ambiguous_layout_defaults_and_override(image_processor):
    # A 3x3x3 array could be HWC or CHW: numpy defaults to HWC, torch to CHW, `input_data_format` decides explicitly.
    cube = _random_uint8((3, 3, 3), seed=9)
    as_hwc = _pixels(image_processor, Image.fromarray(cube), size=8)
    as_chw = _pixels(image_processor, Image.fromarray(cube.transpose(1, 2, 0)), size=8)
    assert not np.array_equal(as_hwc, as_chw)
    np.testing.assert_array_equal(_pixels(image_processor, cube, size=8), as_hwc)
    np.testing.assert_array_equal(_pixels(image_processor, torch.from_numpy(cube), size=8), as_chw)
    np.testing.assert_array_equal(_pixels(image_processor, cube, size=8, input_data_format="channels_first"), as_chw)


def test_mixed_batch(image_processor):
    images = [
        Image.fromarray(_random_uint8((40, 60, 3), seed=10)),
        _random_uint8((25, 25), seed=11),
        torch.from_numpy(_random_uint8((3, 17, 33), seed=12)),
        Image.fromarray(_random_uint8((12, 9, 3), seed=13)).convert("RGBA"),
    ]
    batch = _pixels(image_processor, images, size=32)
    assert batch.shape == (4, 3, 32, 32)
    for row, image in zip(batch, images, strict=True):
        np.testing.assert_array_equal(row, _pixels(image_processor, image, size=32)[0])
    # A tuple is a batch too.
    np.testing.assert_array_equal(_pixels(image_processor, tuple(images), size=32), batch)


def test_return_tensors_none_gives_numpy_arrays(image_processor):
    out = image_processor([Image.new("RGB", (5, 5)), Image.new("RGB", (6, 4))], size=16)["pixel_values"]
    assert len(out) == 2 and all(isinstance(x, np.ndarray) and x.shape == (3, 16, 16) for x in out)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("cat.jpg", "Unsupported image type str"),
        ({"pixels": 1}, "Unsupported image type dict"),
        (3, "Unsupported image type int"),
        (None, "Unsupported image type NoneType"),
        ([], "empty list of images"),
        (Image.new("RGB", (0, 0)), "empty image of size 0x0"),
        (Image.new("L", (0, 7)), "empty image"),
        (np.zeros((0, 5, 3), dtype=np.uint8), "empty image array"),
        (np.array([], dtype=np.float32), "empty image array"),
        (np.zeros(5, dtype=np.uint8), "got 1 dimensions"),
        (np.zeros((1, 2, 5, 5, 3), dtype=np.uint8), "got 5 dimensions"),
        (torch.zeros(2, 3, 5, 5, 1), "got 5 dimensions"),
        (np.zeros((5, 5, 2), dtype=np.uint8), "channel dimension of size 1, 3 or 4"),
        (np.zeros((5, 6, 7), dtype=np.uint8), "channel dimension of size 1, 3 or 4"),
        (np.full((5, 5, 3), 2.0), r"Float image values must lie in \[0, 1\]"),
        (np.full((5, 5), np.nan), "NaN"),
        (np.full((5, 5), 300, dtype=np.int64), r"Integer image values must lie in \[0, 255\]"),
        ([Image.new("RGB", (4, 4)), "oops"], "index 1 of the batch: Unsupported image type str"),
        ([[Image.new("RGB", (4, 4))]], "index 0 of the batch: Unsupported image type list"),
    ],
)
def test_bad_images_raise_value_error(image_processor, bad, match):
    with pytest.raises(ValueError, match=match):
        image_processor(bad)


def test_a_4d_array_or_tensor_is_a_batch_of_images(image_processor):
    images = [_random_uint8((9, 7, 3), seed=seed) for seed in range(2)]
    expected = image_processor(images, return_tensors="pt")["pixel_values"]
    assert torch.equal(image_processor(np.stack(images), return_tensors="pt")["pixel_values"], expected)
    channels_first = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    assert torch.equal(image_processor(channels_first, return_tensors="pt")["pixel_values"], expected)


def test_image_processor_input_names_and_config(image_processor):
    assert OFAImageProcessor.model_input_names == ["pixel_values"]
    config = image_processor.to_dict()
    assert config["image_processor_type"] == "OFAImageProcessor"
    assert config["size"] == {"height": 384, "width": 384}
    assert list(config["image_mean"]) == list(config["image_std"]) == [0.5, 0.5, 0.5]
    assert config["resample"] == Image.BICUBIC


def test_image_processor_remote_code_round_trip(image_processor, tmp_path):
    from transformers import AutoImageProcessor

    image_processor.save_pretrained(tmp_path)
    assert (tmp_path / "processing_ofa.py").is_file()
    reloaded = AutoImageProcessor.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(reloaded).__name__ == "OFAImageProcessor"
    image = Image.fromarray(_random_uint8((21, 13, 3), seed=14))
    np.testing.assert_array_equal(_pixels(reloaded, image), _pixels(image_processor, image))


# --------------------------------------------------------------------------------------------------------------------
# Tokenizer and processor
# --------------------------------------------------------------------------------------------------------------------


def test_caption_prompt_ids(processor):
    out = processor(text=CAPTION_PROMPT)
    assert out["input_ids"] == [CAPTION_PROMPT_IDS]
    assert out["attention_mask"] == [[1] * len(CAPTION_PROMPT_IDS)]


@pytest.mark.parametrize(("word", "token_id"), [(" no", 117), (" yes", 4420), (" maybe", 2085)])
def test_answer_words_are_single_tokens(processor, word, token_id):
    assert processor(text=word)["input_ids"] == [[0, token_id, 2]]


def test_batch_is_right_padded_with_pad_id(processor):
    texts = [" no", CAPTION_PROMPT]
    out = processor(text=texts, return_tensors="pt")
    length = len(CAPTION_PROMPT_IDS)
    assert out["input_ids"].tolist() == [[0, 117, 2] + [1] * (length - 3), CAPTION_PROMPT_IDS]
    assert out["attention_mask"].tolist() == [[1, 1, 1] + [0] * (length - 3), [1] * length]


def test_padding_stays_right_even_if_tokenizer_pads_left(image_processor):
    left_tokenizer = OFAProcessor.build_tokenizer(_require_bart_files())
    left_tokenizer.padding_side = "left"
    processor = OFAProcessor(image_processor=image_processor, tokenizer=left_tokenizer)
    assert processor(text=[" yes", " no maybe"])["input_ids"] == [[0, 4420, 2, 1], [0, 117, 2085, 2]]


def test_padding_side_asked_at_call_time_is_honoured(processor):
    """OFA pads on the right, and the model takes either side (the same outputs): a caller may ask for the left."""
    out = processor(text=[" yes", " no maybe"], padding_side="left")
    assert out["input_ids"] == [[1, 0, 4420, 2], [0, 117, 2085, 2]] and out["attention_mask"][0] == [0, 1, 1, 1]


def test_truncation_to_max_length(processor):
    out = processor(text=[CAPTION_PROMPT, " no"], max_length=4)
    assert out["input_ids"] == [[0, 99, 473, 2], [0, 117, 2, 1]]


def test_code_and_bin_token_ids(tokenizer):
    assert len(tokenizer) == 59457
    assert tokenizer.convert_tokens_to_ids(["<code_0>", "<code_8191>", "<bin_0>", "<bin_999>"]) == [
        50265,
        58456,
        58457,
        59456,
    ]
    assert tokenizer.pad_token_id == 1 and tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 2
    # Idempotent: a second call adds nothing and keeps the ids.
    assert add_ofa_special_tokens(tokenizer) == 0
    assert len(tokenizer) == 59457
    # Bins written without spaces map one-to-one onto ids, and survive skip_special_tokens.
    ids = tokenizer("<bin_1><bin_2><bin_998>")["input_ids"]
    assert ids == [0, 58458, 58459, 59455, 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<bin_1><bin_2><bin_998>"


def test_build_tokenizer_with_fewer_codes_and_bins():
    small = OFAProcessor.build_tokenizer(_require_bart_files(), num_codes=4, num_bins=2)
    assert len(small) == 50265 + 4 + 2
    assert small.convert_tokens_to_ids(["<code_3>", "<bin_0>", "<bin_1>"]) == [50268, 50269, 50270]


def test_images_and_text_together(processor, image_processor):
    images = [Image.fromarray(_random_uint8((40, 30, 3), seed=15)), _random_uint8((10, 10), seed=16)]
    out = processor(images=images, text=[CAPTION_PROMPT, " no"], return_tensors="pt")
    assert set(out.keys()) == {"input_ids", "attention_mask", "pixel_values"}
    assert out["input_ids"].shape == (2, 8) and out["pixel_values"].shape == (2, 3, 384, 384)
    assert out["pixel_values"].dtype == torch.float32
    np.testing.assert_array_equal(out["pixel_values"].numpy(), _pixels(image_processor, images))


def test_images_only_and_image_kwargs_are_routed(processor):
    image = Image.fromarray(_random_uint8((40, 30, 3), seed=17))
    out = processor(images=image, size=64, return_tensors="pt")
    assert set(out.keys()) == {"pixel_values"}
    np.testing.assert_allclose(out["pixel_values"][0].numpy(), _reference_pixels(image, 64, 64), rtol=0, atol=1e-6)


def test_processor_model_input_names(processor):
    assert processor.model_input_names == ["input_ids", "attention_mask", "pixel_values"]


def test_decode_and_batch_decode(processor):
    ids = [CAPTION_PROMPT_IDS, [0, 117, 2, 1, 1, 1, 1, 1]]
    assert processor.decode(CAPTION_PROMPT_IDS, skip_special_tokens=True) == CAPTION_PROMPT
    assert processor.batch_decode(ids, skip_special_tokens=True) == [CAPTION_PROMPT, " no"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "at least one of `images`, `text` or `text_target`"),
        ({"text": 42}, "`text` must be a string or a list of strings, got int"),
        ({"text": [" ok", None]}, "got NoneType at index 1"),
        ({"text": []}, "`text` is an empty list"),
        ({"text": [" a", " b"], "images": Image.new("RGB", (4, 4))}, r"1 image\(s\) but 2 text\(s\)"),
        ({"text": " a", "images": [Image.new("RGB", (4, 4))] * 3}, r"3 image\(s\) but 1 text\(s\)"),
        ({"text": " a", "images": torch.zeros(2, 3, 8, 8)}, r"2 image\(s\) but 1 text\(s\)"),  # a 4-D batch
        ({"text": " a", "images": "cat.jpg"}, "Unsupported image type str"),
        ({"images": []}, "empty list of images"),
    ],
)
def test_processor_bad_inputs_raise_value_error(processor, kwargs, match):
    with pytest.raises(ValueError, match=match):
        processor(**kwargs)


def test_processor_remote_code_round_trip(processor, tmp_path):
    from transformers import AutoProcessor

    processor.save_pretrained(tmp_path)
    saved = {path.name for path in tmp_path.iterdir()}
    assert {"processing_ofa.py", "processor_config.json", "tokenizer.json", "tokenizer_config.json"} <= saved

    reloaded = AutoProcessor.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(reloaded).__name__ == "OFAProcessor"
    assert type(reloaded.image_processor).__name__ == "OFAImageProcessor"
    assert len(reloaded.tokenizer) == 59457

    images = [Image.fromarray(_random_uint8((40, 30, 3), seed=18)), Image.new("L", (7, 9), color=128)]
    texts = [CAPTION_PROMPT, " <bin_0>"]
    expected = processor(images=images, text=texts, return_tensors="pt")
    actual = reloaded(images=images, text=texts, return_tensors="pt")
    assert set(actual.keys()) == set(expected.keys())
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    assert reloaded.model_input_names == processor.model_input_names


def test_options_of_generate_are_refused_and_unknown_ones_ignored_with_a_warning(processor, monkeypatch):
    """A pipeline hands its call's unknown keyword arguments to the processor: an exit knob or a generation option
    there would otherwise change nothing, silently."""
    from hf_earlyexit.modeling import processing_ofa

    for option in ({"exit_threshold": 0.5}, {"exit_mode": "speculative"}, {"temperature": 0.7}):
        with pytest.raises(ValueError, match=f"{next(iter(option))}.*generate_kwargs"):
            processor(text=CAPTION_PROMPT, **option)
    warnings = []
    monkeypatch.setattr(processing_ofa.logger, "warning", warnings.append)
    assert processor(text=CAPTION_PROMPT, bogus=1) == processor(text=CAPTION_PROMPT)
    assert len(warnings) == 1 and "`bogus`" in warnings[0]


@pytest.fixture(scope="module")
def embedded_processor():
    from transformers import AutoProcessor

    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR

    return AutoProcessor.from_pretrained(EMBEDDED_MODEL_DIR)


def test_a_prompt_without_ofas_leading_space_gets_it(embedded_processor):
    """OFA was trained on prompts that start with a space: without it every BPE word would be another token."""
    spaced = embedded_processor(text=[" what color is the shape?", " what shape is in the image?"])
    bare = embedded_processor(text=["what color is the shape?", " what shape is in the image?"])
    assert bare["input_ids"] == spaced["input_ids"]
    assert embedded_processor(text="")["input_ids"] == [embedded_processor.tokenizer("")["input_ids"]] == [[0, 2]]


def test_text_target_gives_the_labels_the_model_and_the_collator_use(embedded_processor):
    from hf_earlyexit.data import ImageTextCollator

    image = Image.fromarray(_random_uint8((64, 64, 3), seed=20))
    rows = [
        {"image": image, "question": " what color?", "answer": "red"},
        {"image": image, "question": " a", "answer": " a red square"},
    ]
    labels = embedded_processor(
        images=[image] * 2,
        text=[r["question"] for r in rows],
        text_target=["red", " a red square"],
        return_tensors="pt",
    )["labels"]
    assert torch.equal(labels, ImageTextCollator(embedded_processor)(rows)["labels"])
    assert labels[0, -1] == -100 and (labels[:, 0] != embedded_processor.tokenizer.bos_token_id).all()
    single = embedded_processor(text=" what color?", text_target="red", return_tensors="pt")
    assert single["labels"].shape == (1, 2) and single["input_ids"].shape[0] == 1
    with pytest.raises(ValueError, match="2 text\\(s\\) but 1 target"):
        embedded_processor(text=[" a", " b"], text_target="red")


def test_grouped_options_reach_the_image_processor_and_the_tokenizer(embedded_processor):
    image = Image.fromarray(_random_uint8((64, 64, 3), seed=21))
    grouped = embedded_processor(
        images=image, text=" a b c d e f", images_kwargs={"size": 32}, text_kwargs={"max_length": 3}
    )
    flat = embedded_processor(images=image, text=" a b c d e f", size=32, max_length=3)
    assert grouped["input_ids"] == flat["input_ids"] and len(flat["input_ids"][0]) == 3
    np.testing.assert_array_equal(np.asarray(grouped["pixel_values"]), np.asarray(flat["pixel_values"]))
    with pytest.raises(ValueError, match="must be dicts"):
        embedded_processor(text=" a", text_kwargs=3)
