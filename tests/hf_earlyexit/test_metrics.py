"""The shipped metric modules, loaded offline from their folders, against hand-computed values."""

import pytest

from hf_earlyexit import metrics

PREDICTIONS = ["a red circle left of a blue square", "a large green triangle"]
REFERENCES = [["a red circle left of a blue square", "a red circle and a blue square"], ["a small green triangle"]]


def test_caption_metrics_equal_hand_computed_values():
    scores = metrics.load("coco_caption").compute(predictions=PREDICTIONS, references=REFERENCES, meteor=False)
    # BLEU-1: clipped unigram matches 8/8 + 3/4 = 11/12; the closest reference lengths (8, 4) sum to the
    # candidates' 12 words, so no brevity penalty.
    assert scores["BLEU-1"] == pytest.approx(11 / 12, abs=1e-6)
    # ROUGE-L (beta 1.2): caption 1 equals a reference (1.0); caption 2 shares the LCS "a green triangle" (3 of 4
    # words each way, so P = R = F = 0.75).
    assert scores["ROUGE-L"] == pytest.approx((1.0 + 0.75) / 2)
    assert scores["CIDEr"] > 0 and scores["METEOR"] is None
    per_sample = metrics.load("coco_caption").compute(
        predictions=PREDICTIONS, references=REFERENCES, meteor=False, per_sample=True
    )["CIDEr_per_sample"]
    assert len(per_sample) == 2 and sum(per_sample) / 2 == pytest.approx(scores["CIDEr"])  # CIDEr is their mean
    other = metrics.load("coco_caption").compute(predictions=[PREDICTIONS[0], "a purple hexagon"],
                                                 references=REFERENCES, meteor=False, per_sample=True)  # fmt: skip
    assert other["CIDEr_per_sample"][0] == pytest.approx(per_sample[0])  # the other outputs do not move a score
    assert scores["SPICE"] is None and "offline" in scores["SPICE_unavailable"]
    for line_break in ("\r", "\x0c", "\u2028"):  # a caption's line break moves no caption onto other references
        broken = [PREDICTIONS[0].replace(" left", line_break + "left"), PREDICTIONS[1]]
        kept = metrics.load("coco_caption").compute(
            predictions=broken, references=REFERENCES, meteor=False, per_sample=True
        )
        assert kept["CIDEr_per_sample"] == pytest.approx(per_sample)
    perfect = metrics.load("coco_caption").compute(predictions=["a red circle"], references=[["a red circle"]],
                                                   meteor=False)  # fmt: skip
    assert perfect["ROUGE-L"] == 1.0 and perfect["BLEU-3"] == pytest.approx(1.0, abs=1e-6)
    # One image: CIDEr-D's document frequencies make every n-gram weigh 0, so it is not given as a silent 0.
    assert perfect["CIDEr"] is None and "at least two" in perfect["CIDEr_unavailable"]
    assert "CIDEr_unavailable" not in scores


def test_the_java_tokenizer_keeps_off_the_console(capfd):
    metrics.load("coco_caption").compute(predictions=PREDICTIONS, references=REFERENCES, meteor=False)
    assert "PTBTokenizer" not in capfd.readouterr().err  # it would break the progress bars around it


def test_meteor_runs_offline_through_java():
    scores = metrics.load("coco_caption").compute(predictions=PREDICTIONS, references=REFERENCES)
    assert 0.3 < scores["METEOR"] < 1.0


def test_vqa_accuracy_normalises_answers_and_counts_agreeing_references():
    vqa = metrics.load("vqa_accuracy")
    assert vqa.compute(predictions=["Two.", "the Circle", "no"], references=[["2"], ["circle"], ["yes"]]) == {
        "accuracy": pytest.approx(2 / 3)
    }
    # VQA v2's official evaluation: min(1, agreeing others / 3) over the 10 humans left out one at a time
    humans = [["blue"] * agree + ["teal"] * (10 - agree) for agree in (1, 2, 3, 4)]
    scores = [vqa.compute(predictions=["blue"], references=[answers])["accuracy"] for answers in humans]
    assert scores == pytest.approx([0.3, 0.6, 0.9, 1.0])
    assert vqa.compute(predictions=["blue"] * 2, references=[["blue", "teal"], ["blue", "blue"]])["accuracy"] == 0.75
    assert vqa.compute(predictions=["Don't know", "dogs"], references=[["dont know"], ["dog's"]])["accuracy"] == 1.0


def test_entailment_accuracy_overall_and_per_label():
    scores = metrics.load("entailment_accuracy").compute(
        predictions=["yes", " No.", "yes", "maybe"], references=["yes", "no", "no", "no"]
    )
    assert scores == {"accuracy": 0.5, "accuracy_no": pytest.approx(1 / 3), "accuracy_yes": 1.0}
    entailment = metrics.load("entailment_accuracy")
    spaced = entailment.compute(predictions=["yes\n", "\tno", "Yes."], references=["yes", "no", " yes\n"])
    assert spaced["accuracy"] == 1.0  # any whitespace around a label, as the punctuation
    assert (
        entailment.compute(predictions=["yes,", "«no»", "(maybe)"], references=["yes", "no", "maybe"])["accuracy"] == 1
    )
    with pytest.raises(ValueError, match="reference label"):
        entailment.compute(predictions=["yes"], references=[" \t"])


def test_an_empty_vqa_reference_is_refused_and_one_that_normalises_to_nothing_is_scored():
    vqa = metrics.load("vqa_accuracy")
    with pytest.raises(ValueError, match="none of them empty"):
        vqa.compute(predictions=[""], references=[[""]])
    # VQA v2 holds the answer "a" (a letter), an article to the normalisation: one such answer stopped the run.
    assert vqa.compute(predictions=["a"], references=[["b"] * 9 + ["a"]])["accuracy"] == pytest.approx(0.3)
    assert vqa.compute(predictions=["b"], references=[["b"] * 9 + ["a"]])["accuracy"] == 1.0


def test_unknown_metric_raises():
    with pytest.raises(ValueError, match="shipped metrics"):
        metrics.load("bleu")


@pytest.mark.parametrize("name", ["vqa_accuracy", "entailment_accuracy", "coco_caption"])
def test_no_predictions_is_an_error_not_a_score_of_zero(name):
    with pytest.raises(ValueError, match="No predictions to score"):
        metrics.load(name).compute(predictions=[], references=[])


def test_an_empty_reference_caption_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="non-empty reference caption"):
        metrics.load("coco_caption").compute(predictions=["a red circle"], references=[[""]], meteor=False)
