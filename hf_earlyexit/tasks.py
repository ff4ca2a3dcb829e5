"""The tasks the embedded model is trained and measured on, each with its splits, prompt, metric and decoding.

- "vqa": easy-VQA questions (13 answers), VQA accuracy.
- "entailment": does a caption hold for the easy-VQA image? (OFA's SNLI-VE prompt, yes/no), entailment accuracy.
- "caption": shape scenes (2-3 objects, 9-19 word captions), COCO caption metrics (CIDEr leads).

Splits are "train", "validation" (for calibration) and "test" (for the benchmark). easy-VQA publishes train and
test only, so its validation split is the questions on every tenth training image (image id divisible by 10),
which "train" leaves out. "calibration" is held out from all three, for a certificate that needs thousands of
samples: shape scenes from their own seed stream, any number of them (`SCENE_SIZES["calibration"]` by default);
easy-VQA has no more images, so its tasks' "calibration" split is their validation split.

Each task names the per-sample loss Learn then Test certifies (`risk_loss`): "binary" for answers (1 where the
answer differs from the full model's), "bounded" for captions (the relative CIDEr drop, `evaluation.relative_drop`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import datasets

from .data import CAPTION_PROMPT, easy_vqa, easy_vqa_captions, easy_vqa_entailment
from .risk_control import LossKind
from .scenes import shape_scenes

SPLITS = ("train", "validation", "test", "calibration")
SCENE_SIZES = {"train": 12000, "validation": 500, "test": 1000, "calibration": 5000}


@dataclass(frozen=True)
class Task:
    """name: the task's key. metric: the `hf_earlyexit.metrics` module that scores it; quality_key: the score the
    calibration and benchmark compare. target_column: the reference in the source data. max_new_tokens / num_beams:
    how it decodes. risk_loss: the kind of per-sample loss against the full model that Learn then Test certifies."""

    name: str
    metric: str
    quality_key: str
    target_column: str
    max_new_tokens: int
    num_beams: int
    risk_loss: LossKind = "binary"

    def dataset(self, split: str, size: int | None = None) -> datasets.Dataset:
        """The split's rows, with columns `image`, `prompt`, `target` and `task`: with `size`, the first `size` of a
        fixed shuffle (all, when an easy-VQA split has fewer; captions' scenes are generated, as many as asked)."""
        if split not in SPLITS:
            raise ValueError(f"Splits are {list(SPLITS)}, got {split!r}.")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"`size` is how many rows to take, a whole number >= 1 (or None: all), got {size!r}.")
        if self.name == "caption":
            rows = shape_scenes(split, size=SCENE_SIZES[split] if size is None else size, image_size=64)
            rows = rows.map(lambda _: {"prompt": CAPTION_PROMPT}, remove_columns=["objects"])
        else:
            rows = easy_vqa_split({"vqa": easy_vqa, "entailment": easy_vqa_entailment}[self.name], split)
            rows = rows.rename_column("question", "prompt").select_columns(["image", "prompt", "answer"])
            if size is not None:
                rows = rows.shuffle(seed=0).select(range(min(size, len(rows))))
        rows = rows.rename_column(self.target_column, "target") if self.target_column != "target" else rows
        return rows.add_column("task", [self.name] * len(rows))


TASKS = {
    "vqa": Task("vqa", "vqa_accuracy", "accuracy", "answer", max_new_tokens=4, num_beams=1),
    "entailment": Task("entailment", "entailment_accuracy", "accuracy", "answer", max_new_tokens=4, num_beams=1),
    "caption": Task("caption", "coco_caption", "CIDEr", "caption", max_new_tokens=24, num_beams=1, risk_loss="bounded"),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; tasks are {list(TASKS)}.")
    return TASKS[name]


def easy_vqa_split(loader: Callable[[str], datasets.Dataset], split: str) -> datasets.Dataset:
    """A split of an easy-VQA-derived set: "test" is the published test split; "validation" (and "calibration")
    the rows of every tenth training image, which "train" leaves out."""
    if split == "test":
        return loader("test")
    held_out = split in ("validation", "calibration")
    return loader("train").filter(lambda image_id: (image_id % 10 == 0) == held_out, input_columns="image_id")


def easy_vqa_caption_rows(split: str) -> datasets.Dataset:
    """easy-VQA's derived captions ("a blue rectangle") in the tasks' columns, for grounding during training."""
    captions = easy_vqa_split(easy_vqa_captions, split)
    captions = captions.rename_column("caption", "target").select_columns(["image", "target"])
    return captions.map(lambda _: {"prompt": CAPTION_PROMPT, "task": "caption"})


# Sampling weights of the embedded model's first training phase: the tasks plus easy-VQA's captions, which ground
# the VQA answers in the image (captions are longest and hardest, so they get the most steps).
MIXTURE = {"vqa": 0.25, "entailment": 0.3, "caption": 0.35, "easy_vqa_caption": 0.1}


def training_mixture(weights: dict[str, float], seed: int = 0) -> tuple[datasets.Dataset, dict[str, datasets.Dataset]]:
    """The train splits of `weights`' parts (task names and "easy_vqa_caption") interleaved with those sampling
    weights until each part was seen once, and the parts. ValueError on an unknown part."""
    unknown = sorted(set(weights) - set(MIXTURE))
    if unknown:
        raise ValueError(f"Unknown mixture part(s) {unknown}; the parts are {sorted(MIXTURE)}.")

    def train_split(name: str) -> datasets.Dataset:
        rows = TASKS[name].dataset("train") if name in TASKS else easy_vqa_caption_rows("train")
        return rows.cast_column("image", datasets.Image())

    parts = {name: train_split(name) for name in weights}
    mixture = datasets.interleave_datasets(
        list(parts.values()), probabilities=list(weights.values()), seed=seed, stopping_strategy="all_exhausted"
    )
    return mixture, parts


__all__ = [
    "MIXTURE",
    "SPLITS",
    "TASKS",
    "Task",
    "easy_vqa_caption_rows",
    "easy_vqa_split",
    "get_task",
    "training_mixture",
]
