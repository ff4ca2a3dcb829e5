"""The demo as a library: a report of what it measured, and its words kept apart from the measuring."""

import dataclasses
from pathlib import Path

import pytest

from hf_earlyexit.data import train_tokenizer
from hf_earlyexit.demo import DemoReport, ExitExample, demo_lines, run_demo
from hf_earlyexit.modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from tests.helpers import tiny_model


def test_run_demo_reports_each_task_and_the_examples_token_by_token(tmp_path, capsys):
    reports = list(run_demo(output_dir=tmp_path, samples={"vqa": 2}, examples={"vqa": 1, "caption": 2}))
    assert capsys.readouterr().out == ""  # the library prints nothing
    assert len(reports) == 3  # loaded, after the task, with the examples: each adds lines to the last one's
    for earlier, later in zip(reports, reports[1:], strict=False):
        assert demo_lines(later)[: len(demo_lines(earlier))] == demo_lines(earlier)
    report = reports[-1]
    assert report.model_dir.name == "embedded_model" and report.knobs  # the calibrated defaults
    assert list(report.tasks) == ["vqa"] and report.tasks["vqa"]["samples"] == 2
    assert set(report.tasks["vqa"]["early_exit"]) >= {"quality", "expected_time_reduction", "mean_layers"}
    assert [example.task for example in report.examples] == ["vqa", "caption", "caption"]
    for example in report.examples:
        assert example.tokens and all(1 <= layer <= report.decoder_layers for _, layer in example.tokens)
        assert all(text for text, _ in example.tokens)  # no empty token printed as "(1)"
        assert all(1 <= layers <= report.encoder_layers for layers in example.encoder_layers)
    assert report.picture == tmp_path / "caption_exits.png" and report.picture.stat().st_size > 0


def test_a_model_without_calibrated_defaults_is_refused(tmp_path):
    tokenizer = train_tokenizer(["what does the image describe?", "a red circle"], vocab_size=300)
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no calibrated exit defaults: run `hf-earlyexit calibrate"):
        next(run_demo(tmp_path, output_dir=tmp_path / "demo"))


def test_demo_lines_say_the_report_in_words():
    side = {"quality": 0.5, "seconds": 2.0, "mean_layers": {"encoder_image": 3, "encoder_text": 2.5,
            "decoder_per_token": 1.25}}  # fmt: skip
    task = {"metric": "accuracy", "full": side, "quality_ratio": 0.98, "wall_clock_time_reduction": 0.25,
            "early_exit": {**side, "quality": 0.49, "seconds": 1.5, "expected_time_reduction": 0.4}}  # fmt: skip
    report = DemoReport(
        model_dir=Path("somewhere"),
        parameters=3_200_000,
        encoder_layers=4,
        decoder_layers=4,
        knobs={"exit_threshold": 0.8},
        threads=2,
        tasks={
            "vqa": task,
            "caption": {
                **task,
                "speculative": {
                    "seconds": 1.6,
                    "same_outputs_as_full": True,
                    "speedup_over_full": 1.25,
                    "acceptance_rate": 0.8,
                    "tokens_per_round": 3.5,
                },
            },
        },
        examples=[ExitExample("caption", " what does the image describe? ", [("a", 1), ("circle", 2)], (3, 2))],
        picture=Path("out/caption_exits.png"),
    )
    assert demo_lines(report) == [
        "Loaded somewhere with AutoModel/AutoProcessor (trust_remote_code=True): OFA-EE, 3.2M parameters, 4 encoder "
        "layers (image and text streams), 4 decoder layers; calibrated exit defaults {'exit_threshold': 0.8}",
        "Each task's test split through the full and the early-exit model, same inputs (2 CPU threads; about 3 "
        "minutes on a 2-core CPU, a progress bar per task; expected time reductions from the part costs measured in "
        "the same rounds):",
        "  vqa        accuracy 0.500 -> 0.490 (98.0% of full) | expected time reduction 40% | wall clock 2.00 s -> "
        "1.50 s (25% less) | layers: image 3.00, text 2.50, decoder 1.25 per token (of 4 / 4)",
        "  caption    accuracy 0.500 -> 0.490 (98.0% of full) | expected time reduction 40% | wall clock 2.00 s -> "
        "1.50 s (25% less) | layers: image 3.00, text 2.50, decoder 1.25 per token (of 4 / 4)\n"
        "             speculative (lossless): the full model's outputs, 2.00 s -> 1.60 s (1.25x), 80% of drafts "
        "accepted, 3.5 tokens per round",
        "Examples (each token with the decoder layer it exited after):",
        "  [caption] what does the image describe? -> a(1) circle(2)  (encoder layers: image 3, text 2)",
        "The captions' exit layers, as a picture: out/caption_exits.png",
    ]
    joint = dataclasses.replace(report, decomposed_encoder=False)  # said "streams" of one joint encoder
    assert "4 encoder layers (image and text together), 4 decoder" in demo_lines(joint)[0]


def test_a_speculative_run_that_never_drafted_says_so():
    """Above `draft_max_batch_size` (`demo --batch-size 16` on the embedded model) no call drafts: no acceptance."""
    side = {
        "quality": 0.5,
        "seconds": 2.0,
        "mean_layers": {"encoder_image": 3, "encoder_text": 2, "decoder_per_token": 1},
    }
    task = {"metric": "CIDEr", "full": side, "quality_ratio": 1.0, "wall_clock_time_reduction": 0.0,
            "early_exit": {**side, "expected_time_reduction": 0.4},
            "speculative": {"seconds": 2.0, "same_outputs_as_full": True, "speedup_over_full": 1.0,
                            "acceptance_rate": None, "tokens_per_round": None}}  # fmt: skip
    report = DemoReport(Path("somewhere"), 3_200_000, 4, 4, {}, 2, tasks={"caption": task})
    assert "no call drafted (more rows than `draft_max_batch_size`" in demo_lines(report)[2]
