"""Image-text data: easy-VQA, a user's data set by path and columns, the tokenizer and the collator."""

import json

import datasets
import pytest
import torch
from PIL import Image

from hf_earlyexit.data import (
    ImageTextCollator,
    easy_vqa,
    easy_vqa_captions,
    easy_vqa_entailment,
    load_image_text_dataset,
    train_tokenizer,
)
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor


def shapes_dataset(size: int = 8) -> datasets.Dataset:
    colours = {"red": (200, 30, 30), "blue": (30, 60, 200)}
    rows = {"image": [], "question": [], "answer": []}
    for i in range(size):
        colour = list(colours)[i % 2]
        rows["image"].append(Image.new("RGB", (64, 64), colours[colour]))
        rows["question"].append("what color is the image?")
        rows["answer"].append(colour)
    return datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())


@pytest.fixture(scope="module")
def processor() -> OFAProcessor:
    tokenizer = train_tokenizer(["what color is the image?", " red", " blue", "a blue circle"], vocab_size=300)
    return OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer)


def test_easy_vqa_is_the_published_split_with_images():
    test = easy_vqa("test")
    assert len(test) == 9673 and test.column_names == ["image", "question", "answer", "image_id"]
    assert test[0]["image"].size == (64, 64)
    assert set(test["answer"]) <= {"circle", "green", "red", "gray", "yes", "teal", "black", "rectangle", "yellow",
                                   "triangle", "brown", "blue", "no"}  # fmt: skip
    with pytest.raises(ValueError, match="splits"):
        easy_vqa("validation")


def test_easy_vqa_captions_agree_with_every_question_of_their_image():
    captions = easy_vqa_captions("test")
    assert 700 < len(captions) <= 1000 and captions.column_names == ["image", "caption", "image_id"]
    caption_of = dict(zip(captions["image_id"], captions["caption"], strict=True))
    questions = easy_vqa("test").remove_columns("image")
    for question, answer, image_id in zip(
        questions["question"], questions["answer"], questions["image_id"], strict=True
    ):
        if image_id not in caption_of:
            continue
        _, colour, shape = caption_of[image_id].split()
        if question in ("what color is the shape?", "what is the color of the shape?"):
            assert answer == colour
        elif question in ("what shape is in the image?", "what shape is present?"):
            assert answer == shape
        elif question in (f"is there a {colour} shape?", f"is there a {shape}?", f"is there not a {shape}?"):
            assert answer == ("no" if " not " in question else "yes")


def test_easy_vqa_entailment_pairs_each_caption_with_one_contradiction():
    entailment = easy_vqa_entailment("test")
    captions = easy_vqa_captions("test")
    assert len(entailment) == 2 * len(captions) and entailment["answer"].count("yes") == len(captions)
    for i in range(0, 40, 2):
        true, false = entailment[i], entailment[i + 1]
        assert (true["answer"], false["answer"]) == ("yes", "no") and true["image_id"] == false["image_id"]
        assert true["question"] == f' does the image describe " {true["hypothesis"]} "?'
        differing = [a != b for a, b in zip(true["hypothesis"].split(), false["hypothesis"].split(), strict=True)]
        assert sum(differing) == 1  # the colour or the shape, not both
    assert easy_vqa_entailment("test")["hypothesis"] == entailment["hypothesis"]  # deterministic


def test_trained_tokenizer_has_ofa_special_ids(processor):
    tokenizer = processor.tokenizer
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode(tokenizer(" blue")["input_ids"], skip_special_tokens=True) == " blue"


def test_collator_makes_labels_from_the_target_with_end_of_sequence(processor):
    batch = ImageTextCollator(processor)([shapes_dataset()[i] for i in range(2)])
    assert batch["pixel_values"].shape == (2, 3, 64, 64)
    blue = processor.tokenizer(" blue")["input_ids"][1:]  # the word then </s>
    red = processor.tokenizer(" red")["input_ids"][1:]
    assert batch["labels"][0, : len(red)].tolist() == red and batch["labels"][1, : len(blue)].tolist() == blue
    assert bool((batch["labels"][batch["labels"] < 0] == -100).all())
    assert processor.batch_decode(batch["input_ids"], skip_special_tokens=True)[0] == " what color is the image?"


def test_collator_without_labels_feeds_the_target_to_the_decoder(processor):
    rows = [shapes_dataset()[i] for i in range(2)]
    with_labels = ImageTextCollator(processor)(rows)
    batch = ImageTextCollator(processor, labels=False)(rows)
    assert "labels" not in batch
    assert batch["decoder_input_ids"][:, 0].tolist() == [0, 0]  # the decoder's start token
    real = batch["decoder_attention_mask"].bool()
    # Each real input but the first is the label before it: the same targets, teacher-forced.
    inputs, labels = batch["decoder_input_ids"][:, 1:], with_labels["labels"][:, :-1]
    assert inputs[real[:, 1:]].tolist() == labels[real[:, 1:]].tolist()
    assert real.sum(1).tolist() == with_labels["labels"].ne(-100).sum(1).tolist()


def test_collator_uses_the_fixed_prompt_without_a_text_column(processor):
    collator = ImageTextCollator(
        processor, text_column=None, target_column="answer", prompt=" what does the image describe?"
    )
    batch = collator([shapes_dataset()[0]])
    assert processor.batch_decode(batch["input_ids"], skip_special_tokens=True) == [" what does the image describe?"]


def test_collator_names_the_columns_the_rows_lack(processor):
    with pytest.raises(ValueError, match=r"no column\(s\) \['caption'\]; their columns are \['answer', 'image'"):
        ImageTextCollator(processor, target_column="caption")([shapes_dataset()[0]])


def test_collator_takes_every_image_form_the_processor_takes(processor, tmp_path):
    dataset = shapes_dataset(2)
    expected = ImageTextCollator(processor)(list(dataset))
    dataset[0]["image"].save(tmp_path / "red.png")
    forms = [
        list(dataset.with_format("numpy")),
        list(dataset.with_format("torch")),
        list(dataset.cast_column("image", datasets.Image(decode=False))),  # {"bytes", "path"}
        [{**dataset[0], "image": str(tmp_path / "red.png")}, {**dataset[1], "image": tmp_path / "red.png"}],
    ]
    for rows in forms[:3]:
        assert torch.equal(ImageTextCollator(processor)(rows)["pixel_values"], expected["pixel_values"])
    assert torch.equal(ImageTextCollator(processor)(forms[3])["pixel_values"][0], expected["pixel_values"][0])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"answer": 3}, r"Column 'answer', row 1: expected text, got 3"),
        ({"answer": []}, r"Column 'answer', row 1: expected text, got \[\]"),
        ({"question": None}, r"Column 'question', row 1: expected text, got None"),
        ({"image": None}, r"Column 'image', row 1: expected an image"),
    ],
)
def test_collator_names_the_column_and_row_of_a_bad_value(processor, change, message):
    rows = list(shapes_dataset(2))
    rows[1] = {**rows[1], **change}
    with pytest.raises(ValueError, match=message):
        ImageTextCollator(processor)(rows)


def test_collator_checks_every_row_and_refuses_an_empty_batch(processor):
    rows = list(shapes_dataset(2))
    rows[1] = {"image": rows[1]["image"], "question": rows[1]["question"]}
    with pytest.raises(ValueError, match=r"no column\(s\) \['answer'\].*\(batch row 1\)"):
        ImageTextCollator(processor)(rows)
    with pytest.raises(ValueError, match="no rows"):
        ImageTextCollator(processor)([])
    answers = ImageTextCollator(processor)([{**dict(shapes_dataset(1)[0]), "answer": ("red", "blue")}])
    assert answers["labels"].tolist() == ImageTextCollator(processor)([dict(shapes_dataset(1)[0])])["labels"].tolist()


def test_collator_truncates_a_prompt_to_the_models_positions():
    from hf_earlyexit.training import small_model_and_processor

    model, processor = small_model_and_processor(["what color is the image?", "red"], vocab_size=300)
    row = {**dict(shapes_dataset(1)[0]), "question": "what color" * 100}
    batch = ImageTextCollator(processor)([row])
    assert batch["input_ids"].shape[1] == model.config.max_position_embeddings
    with torch.no_grad():
        assert model(**batch).loss.isfinite()


def test_load_image_text_dataset_from_disk_and_by_loader(tmp_path):
    shapes_dataset().save_to_disk(tmp_path / "saved")
    assert len(load_image_text_dataset(str(tmp_path / "saved"), columns=["image", "answer"])) == 8
    datasets.DatasetDict({"train": shapes_dataset(4)}).save_to_disk(tmp_path / "dict")
    assert len(load_image_text_dataset(str(tmp_path / "dict"), "train")) == 4
    shapes_dataset(6).to_parquet(tmp_path / "parquet" / "train.parquet")
    loaded = load_image_text_dataset(f"parquet:{tmp_path / 'parquet'}", "train")
    assert len(loaded) == 6 and isinstance(loaded[0]["image"], Image.Image)


def test_image_paths_in_a_loaders_files_are_read_from_its_data_folder(tmp_path, monkeypatch, processor):
    """A JSON data set naming its images relative to its folder (as imagefolder's metadata does) failed from any other
    working folder: "no image at images/0.png"."""
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    rows = []
    for index, color in enumerate(("red", "blue")):
        Image.new("RGB", (32, 32), color).save(folder / "images" / f"{index}.png")
        rows.append({"image": f"images/{index}.png", "question": " what color?", "answer": color})
    (folder / "train-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    Image.new("RGB", (32, 32), "green").save(tmp_path / "elsewhere.png")
    # A path that names no file in the folder is left as given: from the working folder.
    (folder / "train-1.jsonl").write_text(json.dumps({**rows[0], "image": "elsewhere.png"}) + "\n")
    monkeypatch.chdir(tmp_path)  # not the data folder
    for source in (f"json:{folder}", str(folder)):
        loaded = load_image_text_dataset(source, columns=["image", "answer"], image_column="image")
        assert sorted(loaded["image"]) == sorted([*(str(folder / row["image"]) for row in rows), "elsewhere.png"])
        batch = ImageTextCollator(processor, "image", "question", "answer")(list(loaded))
        assert batch["pixel_values"].shape[0] == 3


def test_load_image_text_dataset_names_missing_columns_and_splits(tmp_path):
    shapes_dataset().save_to_disk(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"no column\(s\) \['caption'\]; its columns are"):
        load_image_text_dataset(str(tmp_path / "saved"), columns=["image", "caption"])
    datasets.DatasetDict({"train": shapes_dataset(4)}).save_to_disk(tmp_path / "dict")
    with pytest.raises(ValueError, match="not 'test'"):
        load_image_text_dataset(str(tmp_path / "dict"), "test")
    with pytest.raises(ValueError, match="holds one data set, not a split 'test'"):  # never silently the whole folder
        load_image_text_dataset(str(tmp_path / "saved"), "test")
    with pytest.raises(ValueError, match="json:nope: no folder nope for the 'json' loader"):  # was `datasets`' own
        load_image_text_dataset("json:nope")
    (tmp_path / "file.jsonl").write_text("{}")
    with pytest.raises(ValueError, match="no folder .*file.jsonl for the 'json' loader"):  # a file, not a folder
        load_image_text_dataset(f"json:{tmp_path / 'file.jsonl'}")
    datasets.Dataset.from_dict({"image": [], "answer": []}).save_to_disk(tmp_path / "empty")
    with pytest.raises(ValueError, match="has no rows"):
        load_image_text_dataset(str(tmp_path / "empty"))


def test_small_model_trains_on_a_data_set_by_column_names(tmp_path, processor):
    from hf_earlyexit import EarlyExitTrainingArguments
    from hf_earlyexit.training import small_model_and_processor, train_exits

    model, processor = small_model_and_processor(["what color is the image?", "red", "blue"], vocab_size=300)
    args = EarlyExitTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True,
        logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    before = model.decoder.layers[0].fc1.weight.detach().clone()
    trainer = train_exits(model, processor, shapes_dataset(), args)
    assert not torch.equal(before, model.decoder.layers[0].fc1.weight)
    assert "loss_exit_1" in trainer.state.log_history[0]
    with pytest.raises(ValueError, match="no column"):
        train_exits(model, processor, shapes_dataset(), args, target_column="caption")
    # A row without text is found before the first step, not when its batch comes.
    rows = len(shapes_dataset())
    for answers, row, bad in (([7] * rows, 0, 7), ([*shapes_dataset()["answer"][:-1], None], rows - 1, None)):
        dataset = shapes_dataset().remove_columns("answer").add_column("answer", answers)
        with pytest.raises(ValueError, match=rf"Column 'answer', row {row}: expected text, got {bad}"):
            train_exits(model, processor, dataset, args)
