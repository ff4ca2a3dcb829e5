"""Image-text data for training exits: easy-VQA, a user's own data set by column names, a small tokenizer trained
on a data set's text, and the collator that turns rows into model inputs with labels."""

import io
import os
import random
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
from PIL import Image
from transformers import BartTokenizer, PreTrainedTokenizerBase
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from .loading import open_image

CAPTION_PROMPT = " what does the image describe?"  # OFA's caption prompt
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4, as OFA's BART BPE (bos 0, pad 1, eos 2)


def easy_vqa_package_split(split: str) -> tuple[list[str], list[str], list[int], dict[int, str]]:
    """The raw easy-VQA split (the `easy-vqa` package): questions, answers, image ids and each image's PNG path."""
    import easy_vqa as source

    loaders = {
        "train": (source.get_train_questions, source.get_train_image_paths),
        "test": (source.get_test_questions, source.get_test_image_paths),
    }
    if split not in loaders:
        raise ValueError(f"easy-VQA has splits {list(loaders)}, got {split!r}.")
    get_questions, get_paths = loaders[split]
    questions, answers, image_ids = get_questions()
    return questions, answers, image_ids, get_paths()


def easy_vqa(split: str = "train") -> datasets.Dataset:
    """easy-VQA (Victor Zhou, MIT): 64x64 images of one coloured shape, with questions about its shape, colour or
    presence and 13 answers. Columns: `image` (PIL), `question`, `answer`, `image_id`. Splits "train" (38,575
    questions on 4,000 images) and "test" (9,673 on 1,000)."""
    questions, answers, image_ids, paths = easy_vqa_package_split(split)
    table = {
        "image": [paths[image_id] for image_id in image_ids],
        "question": questions,
        "answer": answers,
        "image_id": image_ids,
    }
    return datasets.Dataset.from_dict(table).cast_column("image", datasets.Image())


EASY_VQA_SHAPES = ("circle", "rectangle", "triangle")


def easy_vqa_captions(split: str = "train") -> datasets.Dataset:
    """One caption per easy-VQA image, "a blue rectangle", from the colour and shape its questions' answers give
    (images whose questions give only one of them are left out). Columns: `image`, `caption`, `image_id`."""
    return datasets.Dataset.from_dict(easy_vqa_caption_table(split)).cast_column("image", datasets.Image())


def easy_vqa_caption_table(split: str) -> dict[str, list]:
    """`easy_vqa_captions` as columns, with image paths."""
    questions, answers, image_ids, paths = easy_vqa_package_split(split)
    colours: dict[int, str] = {}
    shapes: dict[int, str] = {}
    for question, answer, image_id in zip(questions, answers, image_ids, strict=True):
        named_shape = next((shape for shape in EASY_VQA_SHAPES if f" {shape}" in question), None)
        if question.startswith(("what color", "what is the color")):
            colours[image_id] = answer
            if named_shape:
                shapes[image_id] = named_shape
        elif question.startswith(("what shape", "what is the")):
            shapes[image_id] = answer
    known = sorted(set(colours) & set(shapes))
    return {
        "image": [paths[image_id] for image_id in known],
        "caption": [f"a {colours[image_id]} {shapes[image_id]}" for image_id in known],
        "image_id": known,
    }


def easy_vqa_entailment(split: str = "train", seed: int = 0) -> datasets.Dataset:
    """Visual entailment from easy-VQA captions: per image, its caption as an entailed hypothesis ("yes") and the
    caption with the colour or the shape changed as a contradiction ("no"), in OFA's SNLI-VE prompt. Columns:
    `image`, `question`, `answer`, `hypothesis`, `image_id`; deterministic for a `seed`."""
    captions = easy_vqa_caption_table(split)
    colours = sorted({caption.split()[1] for caption in captions["caption"]})
    rng = random.Random(f"easy-vqa-entailment-{split}-{seed}")
    rows: dict[str, list] = {"image": [], "hypothesis": [], "answer": [], "image_id": []}
    for path, caption, image_id in zip(captions["image"], captions["caption"], captions["image_id"], strict=True):
        _, colour, shape = caption.split()
        if rng.random() < 0.5:
            wrong = f"a {rng.choice([c for c in colours if c != colour])} {shape}"
        else:
            wrong = f"a {colour} {rng.choice([s for s in EASY_VQA_SHAPES if s != shape])}"
        for hypothesis, answer in ((caption, "yes"), (wrong, "no")):
            rows["image"].append(path)
            rows["hypothesis"].append(hypothesis)
            rows["answer"].append(answer)
            rows["image_id"].append(image_id)
    rows["question"] = [f' does the image describe " {hypothesis} "?' for hypothesis in rows["hypothesis"]]
    return datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())


# The loaders `datasets` ships, which `loader:folder` names.
LOADERS = frozenset(_PACKAGED_DATASETS_MODULES)


def loader_and_folder(source: str) -> tuple[str, str] | None:
    """A `loader:folder` source as (loader, folder): a `datasets` loader's name, or any name before a path that
    exists; None for a source of another form."""
    loader, separator, folder = source.partition(":")
    return (loader, folder) if separator and (loader in LOADERS or Path(folder).exists()) else None


def load_image_text_dataset(
    source: str, split: str | None = None, columns: Iterable[str] = (), image_column: str | None = None
) -> datasets.Dataset:
    """A split of a data set: a folder written by `save_to_disk`, a loader with a local folder (`"imagefolder"`,
    `"parquet"`, ...: give `source` as `loader:path`) or a name `datasets.load_dataset` resolves. `split` defaults to
    "train"; a folder holding one data set is that data set, so a split it is not is refused. Raises ValueError when
    the split is not there, has no rows, or lacks a column in `columns`. Image paths in `image_column` that are
    relative to a loader's data folder (as `imagefolder`'s metadata names its files) are made to point there."""
    path = Path(source)
    data_dir = None
    if path.is_dir() and any((path / name).exists() for name in ("dataset_dict.json", "state.json")):
        loaded = load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            if (split or "train") not in loaded:
                raise ValueError(f"{source} has splits {list(loaded)}, not {split or 'train'!r}.")
            loaded = loaded[split or "train"]
        elif split is not None and split != loaded.split:
            raise ValueError(f"{source} holds one data set, not a split {split!r} of one: drop the split.")
    elif (named := loader_and_folder(source)) is not None:
        loader, data_dir = named
        if not Path(data_dir).is_dir():  # `datasets` said "Couldn't find any data file at <cwd>/json:<path>"
            raise ValueError(f"{source}: no folder {data_dir} for the {loader!r} loader to read.")
        loaded = datasets.load_dataset(loader, data_dir=data_dir, split=split or "train")
    else:
        loaded = datasets.load_dataset(source, split=split or "train")
        data_dir = source if path.is_dir() else None
    if len(loaded) == 0:
        raise ValueError(f"{source} has no rows.")
    missing = [column for column in columns if column and column not in loaded.column_names]
    if missing:
        raise ValueError(f"{source} has no column(s) {missing}; its columns are {loaded.column_names}.")
    if data_dir is not None and image_column in loaded.column_names:
        loaded = with_paths_from(Path(data_dir), loaded, image_column)
    return loaded


def with_paths_from(folder: Path, dataset: datasets.Dataset, column: str) -> datasets.Dataset:
    """`dataset` with the relative paths in `column` that name a file in `folder` made to point there; a column that
    holds no paths (images, bytes) as it is."""
    if dataset.features[column] != datasets.Value("string"):
        return dataset
    paths = [
        str(folder / value) if value and not os.path.isabs(value) and (folder / value).is_file() else value
        for value in dataset[column]
    ]
    return dataset.remove_columns(column).add_column(column, paths)


def load_from_disk(path: Path) -> datasets.Dataset | datasets.DatasetDict:
    """`datasets.load_from_disk`, whose IndexError on a data set of no rows becomes a ValueError that says so."""
    try:
        return datasets.load_from_disk(str(path))
    except IndexError:
        raise ValueError(f"{path} has no rows.") from None


def train_tokenizer(texts: Iterable[str], vocab_size: int = 600) -> PreTrainedTokenizerBase:
    """A byte-level BPE (the kind OFA's BART tokenizer is) trained on `texts`, with OFA's special-token ids."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    with tempfile.TemporaryDirectory() as folder:
        bpe.save_model(folder)
        return BartTokenizer.from_pretrained(folder)


def row_text(value: Any, column: str, row: int, lists: bool = False) -> str:
    """A row's text: a string, or with `lists` a non-empty list (or tuple) of them, whose first is the target.
    ValueError naming the column and the row otherwise."""
    texts = value if lists and isinstance(value, (list, tuple)) and value else [value]
    if not all(isinstance(text, str) for text in texts):
        raise ValueError(f"Column {column!r}, row {row}: expected text, got {value!r}.")
    return texts[0]


def row_image(value: Any, column: str, row: int) -> Any:
    """A row's image as the processor takes it: a PIL image, an array or a tensor as it is; a path, or an undecoded
    `datasets.Image` ({"bytes", "path"}), opened. ValueError naming the column and the row otherwise."""
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, (str, os.PathLike, io.BytesIO)):
        try:
            return open_image(value)
        except ValueError as error:
            raise ValueError(f"Column {column!r}, row {row}: {error}") from None
    if isinstance(value, (Image.Image, np.ndarray, torch.Tensor)):
        return value
    raise ValueError(f"Column {column!r}, row {row}: expected an image (PIL, array, tensor or path), got {value!r}.")


@dataclass
class ImageTextCollator:
    """Rows of an image-text data set -> `input_ids`, `attention_mask`, `pixel_values` and `labels` (the target's
    tokens then `</s>`, padding as -100).

    processor: an `OFAProcessor` (it gives each prompt and target OFA's leading space).
    image_column: a PIL image, an array, a tensor or a path per row.
    text_column: the prompt per row (a question); None uses `prompt` for every row (captioning). Prompts longer than
        the tokenizer's `model_max_length` (the model's positions, when the processor was saved with a model) are
        truncated.
    target_column: the answer or caption per row; a list of strings takes the first.
    max_target_length: the most target tokens a label holds (`</s>` included).
    labels: False gives the target as `decoder_input_ids` and `decoder_attention_mask` (from the start token on)
        instead of `labels`, for the losses that learn from the last layer's distribution alone (BLIPEE without
        labels).
    """

    processor: Any
    image_column: str = "image"
    text_column: str | None = "question"
    target_column: str = "answer"
    prompt: str = CAPTION_PROMPT
    max_target_length: int = 32
    labels: bool = True

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("The collator got no rows: a batch needs at least one.")
        columns = [self.image_column, *([self.text_column] if self.text_column else []), self.target_column]
        images, prompts, targets = [], [], []
        for index, row in enumerate(rows):
            missing = [column for column in columns if column not in row]
            if missing:
                raise ValueError(
                    f"The rows have no column(s) {missing}; their columns are {sorted(row)} (batch row {index}): "
                    "name the collator's `image_column`, `text_column` and `target_column`."
                )
            images.append(row_image(row[self.image_column], self.image_column, index))
            prompt = row_text(row[self.text_column], self.text_column, index) if self.text_column else self.prompt
            prompts.append(prompt)
            targets.append(row_text(row[self.target_column], self.target_column, index, lists=True))
        fits = self.processor.tokenizer.model_max_length < VERY_LARGE_INTEGER  # a limit the tokenizer knows
        batch = self.processor(images=images, text=prompts, truncation=fits, return_tensors="pt")
        length = self.max_target_length + 1  # with <s>, which the labels drop
        labels = self.processor(text_target=targets, max_length=length, return_tensors="pt")["labels"]
        if self.labels:
            batch["labels"] = labels
            return dict(batch)
        # The decoder reads <s> and the target; an input is real where a next token is.
        start = torch.full_like(labels[:, :1], self.processor.tokenizer.bos_token_id)
        inputs = torch.cat([start, labels[:, :-1]], dim=1)
        batch["decoder_input_ids"] = inputs.masked_fill(inputs == -100, self.processor.tokenizer.pad_token_id)
        batch["decoder_attention_mask"] = labels.ne(-100).long()
        return dict(batch)


__all__ = [
    "CAPTION_PROMPT",
    "ImageTextCollator",
    "easy_vqa",
    "easy_vqa_captions",
    "easy_vqa_entailment",
    "load_image_text_dataset",
    "train_tokenizer",
]
