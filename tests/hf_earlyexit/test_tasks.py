"""The tasks' splits: columns, disjoint train / validation images, fixed samples."""

import pytest

from hf_earlyexit.tasks import easy_vqa_caption_rows, get_task


def test_easy_vqa_validation_holds_every_tenth_training_image_which_train_leaves_out():
    task = get_task("vqa")
    train, validation = task.dataset("train"), task.dataset("validation")
    assert train.column_names == validation.column_names == ["image", "prompt", "target", "task"]
    assert len(train) + len(validation) == 38575  # the published training questions
    entailment = get_task("entailment").dataset("validation")
    assert set(entailment["target"]) == {"yes", "no"} and entailment[0]["prompt"].startswith(" does the image")
    assert len(easy_vqa_caption_rows("validation")) + len(easy_vqa_caption_rows("train")) == 2919


def test_samples_are_a_fixed_subset_and_captions_come_from_shape_scenes():
    task = get_task("vqa")
    assert task.dataset("test", size=5)["prompt"] == task.dataset("test", size=5)["prompt"]
    captions = get_task("caption").dataset("validation", size=3)
    assert len(captions) == 3 and all(8 <= len(text.split()) <= 20 for text in captions["target"])
    assert captions[0]["image"].size == (64, 64)


def test_unknown_task_or_split_raises():
    with pytest.raises(ValueError, match="Unknown task 'ocr'"):
        get_task("ocr")
    with pytest.raises(ValueError, match="Splits are"):
        get_task("vqa").dataset("dev")
    for name in ("vqa", "entailment", "caption"):  # the same answer from every task, never an empty split
        for size in (0, -1, 2.5):
            with pytest.raises(ValueError, match=f"`size` is how many rows to take.*got {size}"):
                get_task(name).dataset("test", size=size)


def test_calibration_splits_are_held_out_and_as_large_as_asked():
    caption = get_task("caption")
    calibration = caption.dataset("calibration", size=40)
    assert len(calibration) == 40 and caption.risk_loss == "bounded"
    others = {text for split in ("train", "validation", "test") for text in caption.dataset(split, size=40)["target"]}
    images = {split: caption.dataset(split, size=40)["image"][0].tobytes() for split in ("validation", "calibration")}
    assert images["validation"] != images["calibration"] and len(set(calibration["target"]) - others) > 0
    vqa = get_task("vqa")  # easy-VQA has no more images: its calibration split is its validation split
    assert vqa.dataset("calibration", size=5)["prompt"] == vqa.dataset("validation", size=5)["prompt"]
    assert vqa.risk_loss == get_task("entailment").risk_loss == "binary"
