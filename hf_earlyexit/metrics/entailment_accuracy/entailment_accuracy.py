"""Visual-entailment accuracy: the fraction of predicted labels ("yes" / "no" / "maybe", or any label set) equal to
the reference after lower-casing and stripping spaces and punctuation; also the accuracy per reference label."""

import re

import datasets
import evaluate

_DESCRIPTION = __doc__
_CITATION = "Xie et al., Visual Entailment: A Novel Task for Fine-Grained Image Understanding, arXiv:1901.06706."
_KWARGS_DESCRIPTION = """
Args:
    predictions: one generated label per pair.
    references: the reference label of each pair.
Returns:
    "accuracy", and "accuracy_<label>" for each reference label.
"""


def normalize(label: str) -> str:
    """Lower case, without the spaces and punctuation around it ("Yes," and "«no»" are labels)."""
    return re.sub(r"^[\W_]+|[\W_]+$", "", label.lower())


class EntailmentAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references) -> dict:
        if not predictions:
            raise ValueError("No predictions to score: an accuracy needs at least one pair.")
        if not all(normalize(reference) for reference in references):
            raise ValueError("Every pair needs a reference label; an empty one (or only punctuation) was given.")
        correct = [normalize(p) == normalize(r) for p, r in zip(predictions, references, strict=True)]
        result = {"accuracy": sum(correct) / len(correct) if correct else 0.0}
        for label in sorted({normalize(r) for r in references}):
            hits = [c for c, r in zip(correct, references, strict=True) if normalize(r) == label]
            result[f"accuracy_{label}"] = sum(hits) / len(hits)
        return result
