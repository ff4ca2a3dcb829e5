"""COCO caption metrics through pycocoevalcap: BLEU-1..4, METEOR 1.5 (Java), ROUGE-L, CIDEr-D; SPICE is reported
as unavailable (it downloads Stanford CoreNLP at first use, which an offline machine cannot)."""

import contextlib
import os
import sys
import tempfile

import datasets
import evaluate

_DESCRIPTION = __doc__
_CITATION = "Chen et al., Microsoft COCO Captions: Data Collection and Evaluation Server, arXiv:1504.00325 (2015)."
_KWARGS_DESCRIPTION = """
Args:
    predictions: one caption per image.
    references: the reference captions of each image.
    meteor: run METEOR (starts a Java process, about 9 s the first time); default True.
    per_sample: also "CIDEr_per_sample", each image's CIDEr (None for a single image); default False.
Returns:
    "BLEU-1".."BLEU-4", "METEOR" (None when not run), "ROUGE-L", "CIDEr" (None for a single image, with
    "CIDEr_unavailable" saying why), and "SPICE": None with "SPICE_unavailable" saying why. Texts go through the
    PTB tokenizer (Java), as the COCO server does.
"""
SPICE_UNAVAILABLE = "SPICE needs Stanford CoreNLP 3.6.0, which it downloads at first use; this machine is offline."
CIDER_UNAVAILABLE = (
    "CIDEr-D weighs n-grams by their document frequency over the scored images' references, so one image scores 0 "
    "whatever its caption: score at least two."
)


@contextlib.contextmanager
def java_output_kept_aside():
    """The PTB tokenizer's Java process writes a progress line per call to the inherited stderr, which breaks the
    progress bars around it: send the process's stderr to a file, and into the error if tokenizing fails."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except Exception as error:
            sink.seek(0)
            raise RuntimeError(f"The PTB tokenizer (Java) failed: {sink.read().decode(errors='replace')}") from error
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def one_line(caption: str) -> str:
    """`caption` with every run of whitespace as one space: the Java tokenizer splits lines at `\r`, `\x0c` or
    U+2028 too, which would shift every later caption onto another's references."""
    return " ".join(caption.split())


class CocoCaption(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
            ),
        )

    def _compute(self, predictions, references, meteor: bool = True, per_sample: bool = False) -> dict:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        if not predictions:
            raise ValueError("No predictions to score: the caption metrics need at least one caption.")
        if any(len(refs) == 0 or not any(ref.strip() for ref in refs) for refs in references):
            raise ValueError("Every prediction needs at least one non-empty reference caption.")
        tokenizer = PTBTokenizer()
        with java_output_kept_aside():  # the tokenizer reads one caption per line: other line breaks become spaces
            gts = tokenizer.tokenize({i: [{"caption": one_line(r)} for r in refs] for i, refs in enumerate(references)})
            res = tokenizer.tokenize({i: [{"caption": one_line(p)}] for i, p in enumerate(predictions)})
        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        scores = {f"BLEU-{n}": float(value) for n, value in enumerate(bleu, start=1)}
        scores["METEOR"] = None
        if meteor:
            from pycocoevalcap.meteor.meteor import Meteor

            scores["METEOR"] = float(Meteor().compute_score(gts, res)[0])
        scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
        cider, cider_per_sample = Cider().compute_score(gts, res)
        scores["CIDEr"] = float(cider) if len(predictions) > 1 else None
        if per_sample:  # CIDEr-D's document frequencies come from the references, so a sample's score is its own
            scores["CIDEr_per_sample"] = [float(value) for value in cider_per_sample] if len(predictions) > 1 else None
        if len(predictions) == 1:
            scores["CIDEr_unavailable"] = CIDER_UNAVAILABLE
        scores["SPICE"] = None
        scores["SPICE_unavailable"] = SPICE_UNAVAILABLE
        return scores
