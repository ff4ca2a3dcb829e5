"""VQA accuracy (Antol et al.): an answer scores the mean, over the question's references left out one at a time, of
min(1, #other references equal to it / 3), after a normalisation (lower case; digit grouping commas, punctuation and
apostrophes dropped; articles dropped; number words as digits). With 10 references (VQA v2) this is the official
formula, but not quite the official script's normalisation, which keeps %, $, :, & and * and maps a list of
contractions: "50%" and "50" agree here, not there, so VQA v2 scores may come out a little higher. With fewer
references the divisor is at most the others' count (2 references: agreeing with the other one scores 1); with one
(easy-VQA) it is exact match."""

import re

import datasets
import evaluate

_DESCRIPTION = __doc__
_CITATION = "Antol et al., VQA: Visual Question Answering, ICCV 2015."
_KWARGS_DESCRIPTION = """
Args:
    predictions: one answer per question.
    references: the reference answers of each question (VQA v2 has 10, easy-VQA 1).
Returns:
    "accuracy": the mean score.
"""
NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
           "seven": "7", "eight": "8", "nine": "9", "ten": "10"}  # fmt: skip
ARTICLES = {"a", "an", "the"}


def normalize(answer: str) -> str:
    answer = re.sub(r"(?<=\d),(?=\d)", "", answer.lower().strip())  # 1,000 -> 1000
    answer = re.sub(r"[^\w\s']", " ", answer).replace("'", "")  # "don't" and "dont" alike
    words = [NUMBERS.get(word, word) for word in answer.split() if word not in ARTICLES]
    return " ".join(words)


def leave_one_out_score(prediction: str, answers: list[str]) -> float:
    """The official per-question score: min(1, matches among the other references / 3), averaged over the reference
    left out; the divisor is at most the others' count, and one reference is exact match."""
    if len(answers) == 1:
        return float(prediction == answers[0])
    matches = sum(answer == prediction for answer in answers)
    divisor = min(3, len(answers) - 1)
    return sum(min(1.0, (matches - (answer == prediction)) / divisor) for answer in answers) / len(answers)


class VqaAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references) -> dict:
        if not predictions:
            raise ValueError("No predictions to score: an accuracy needs at least one question.")
        scores = []
        for prediction, answers in zip(predictions, references, strict=True):
            # An answer that normalises to nothing ("a", an article) is still an answer; an empty one is no answer.
            if not answers or not all(answer.strip() for answer in answers):
                raise ValueError("Every question needs at least one reference answer, and none of them empty.")
            scores.append(leave_one_out_score(normalize(prediction), [normalize(answer) for answer in answers]))
        return {"accuracy": sum(scores) / len(scores) if scores else 0.0}
