"""Metrics as `evaluate` modules shipped inside the package and loaded from their folders (never the Hub):
`load("coco_caption")`, `load("vqa_accuracy")`, `load("entailment_accuracy")`."""

from pathlib import Path

import evaluate

METRICS = ("coco_caption", "vqa_accuracy", "entailment_accuracy")


def load(name: str) -> evaluate.EvaluationModule:
    """The shipped metric `name`, as `evaluate.load` gives it."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}; the shipped metrics are {list(METRICS)}.")
    return evaluate.load(str(Path(__file__).parent / name))


__all__ = ["METRICS", "load"]
