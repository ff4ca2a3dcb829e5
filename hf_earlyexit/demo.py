"""The demo behind `hf-earlyexit demo`: a calibrated model (by default the one that ships in the package) against
the full model on each task's test split, a few answers and captions with the layer each token exited after, and
those captions as a picture. `run_demo` yields what it has measured so far; `demo_lines` says it in words."""

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .benchmark import task_benchmark
from .evaluation import run_knobs, task_inputs
from .loading import EMBEDDED_MODEL_DIR, load_model_and_processor
from .plots import check_plot_path, exit_picture

# Test rows per task for the full vs early-exit comparison, and examples per task shown token by token.
DEMO_SAMPLES = {"vqa": 200, "entailment": 200, "caption": 100}
DEMO_EXAMPLES = {"vqa": 3, "entailment": 2, "caption": 4}
# The tasks shown in speculative mode too: a caption has tokens to draft, an answer hardly any.
SPECULATIVE_TASKS = ("caption",)


@dataclass
class ExitExample:
    """One prompt's output: each generated token with the decoder layer it exited after, and the encoder layers
    its image and text ran (each stream's own in a decomposed encoder, the same in a joint one)."""

    task: str
    prompt: str
    tokens: list[tuple[str, int]]
    encoder_layers: tuple[int, int]


@dataclass
class DemoReport:
    """What the demo measured. tasks: per task, `benchmark.task_benchmark`'s report (full vs `knobs`)."""

    model_dir: Path
    parameters: int
    encoder_layers: int
    decoder_layers: int
    knobs: dict[str, Any]
    threads: int
    decomposed_encoder: bool = True  # image and text as separate streams (MuE's), else one joint encoder
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples: list[ExitExample] = field(default_factory=list)
    picture: Path | None = None  # None when no caption was decoded (or not yet)


def run_demo(
    model_dir: str | Path | None = None,
    output_dir: str | Path = "out/demo",
    batch_size: int = 1,
    samples: dict[str, int] = DEMO_SAMPLES,
    examples: dict[str, int] = DEMO_EXAMPLES,
) -> Iterator[DemoReport]:
    """Load the model in `model_dir` (default: the embedded one) with its calibrated exit defaults, benchmark them
    against the full model on `samples` test rows per task, decode `examples` prompts per task token by token and
    draw the captions' exit layers to `output_dir`/caption_exits.png.

    Yields the report as it grows (loaded, then after each task, then with the examples and the picture), so that a
    caller can show progress; the last one is complete. ValueError when the model has no calibrated exit defaults.
    """
    model_dir = Path(model_dir or EMBEDDED_MODEL_DIR)
    check_plot_path(Path(output_dir) / "caption_exits.png", "--output-dir")  # before minutes of work, not after
    model, processor = load_model_and_processor(model_dir)
    knobs = run_knobs(model)
    if not knobs:
        raise ValueError(
            f"{model_dir} has no calibrated exit defaults: run `hf-earlyexit calibrate {model_dir} --write`."
        )
    config = model.config
    report = DemoReport(
        model_dir, model.num_parameters(), config.encoder_layers, config.decoder_layers, knobs,
        torch.get_num_threads(), config.decompose_encoder_modalities,
    )  # fmt: skip
    yield report
    speculative = run_knobs(model, exit_mode="speculative")  # the same exits, drafting for the full model
    for name, count in samples.items():
        inputs = task_inputs(name, processor, "test", count, batch_size)
        drafts = speculative if name in SPECULATIVE_TASKS else None
        progress = f"{name}: {count} test rows, full model vs exits{' vs speculative' if drafts else ''}"
        task = task_benchmark(model, processor, inputs, knobs, 1, speculative=drafts, progress=progress)
        report = replace(report, tasks={**report.tasks, name: task})
        yield report
    shown = [
        example for name, count in examples.items() for example in exit_examples(model, processor, knobs, name, count)
    ]
    captions = [example.tokens for example in shown if example.task == "caption"]
    picture = (
        exit_picture(captions, config.decoder_layers, Path(output_dir) / "caption_exits.png") if captions else None
    )
    yield replace(report, examples=shown, picture=picture)


@torch.no_grad()
def exit_examples(model, processor, knobs: dict[str, Any], task: str, count: int) -> list[ExitExample]:
    """The first `count` test prompts of `task`, greedy-decoded in one batch with `knobs`; special tokens left out."""
    inputs = task_inputs(task, processor, "test", count, count)
    batch = inputs.batches[0]
    out = model.generate(
        **batch, **knobs, max_new_tokens=inputs.task.max_new_tokens, do_sample=False, return_dict_in_generate=True
    )
    special = set(processor.tokenizer.all_special_ids)
    prompts = processor.batch_decode(batch["input_ids"], skip_special_tokens=True)
    examples = []
    for row, prompt in enumerate(prompts):
        generated = zip(out.sequences[row, 1:].tolist(), out.exit_layers[row].tolist(), strict=True)
        decoded = [(processor.tokenizer.decode([token]).strip(), int(layer)) for token, layer in generated
                   if token not in special]  # fmt: skip
        tokens = [(text, layer) for text, layer in decoded if text]  # a lone space token shows as nothing
        image_layers, text_layers = out.encoder_exit_layers[row].tolist()
        examples.append(ExitExample(task, prompt, tokens, (image_layers, text_layers)))
    return examples


def task_line(name: str, report: dict[str, Any], encoder_layers: int, decoder_layers: int) -> str:
    """One task's full vs early-exit comparison on one line, and speculative mode's on the next."""
    full, early = report["full"], report["early_exit"]
    layers = early["mean_layers"]
    line = (
        f"  {name:<10} {report['metric']} {full['quality']:.3f} -> {early['quality']:.3f} "
        f"({100 * report['quality_ratio']:.1f}% of full) | expected time reduction "
        f"{100 * early['expected_time_reduction']:.0f}% | wall clock {full['seconds']:.2f} s -> "
        f"{early['seconds']:.2f} s ({100 * report['wall_clock_time_reduction']:.0f}% less) | layers: image "
        f"{layers['encoder_image']:.2f}, text {layers['encoder_text']:.2f}, decoder "
        f"{layers['decoder_per_token']:.2f} per token (of {encoder_layers} / {decoder_layers})"
    )
    speculative = report.get("speculative")
    if speculative is None:
        return line
    same = "the full model's outputs" if speculative["same_outputs_as_full"] else "OUTPUTS DIFFER from the full model"
    drafts = (
        "no call drafted (more rows than `draft_max_batch_size`: the full model decoded)"
        if speculative["acceptance_rate"] is None
        else f"{100 * speculative['acceptance_rate']:.0f}% of drafts accepted, "
        f"{speculative['tokens_per_round']:.1f} tokens per round"
    )
    return (
        f"{line}\n  {'':<10} speculative (lossless): {same}, {full['seconds']:.2f} s -> {speculative['seconds']:.2f} s "
        f"({speculative['speedup_over_full']:.2f}x), {drafts}"
    )


def example_line(example: ExitExample) -> str:
    """A prompt and its output, each token with its exit layer: `  [caption]prompt -> a(1) red(2) ...`."""
    shown = " ".join(f"{token}({layer})" for token, layer in example.tokens)
    image_layers, text_layers = example.encoder_layers
    return (
        f"  [{example.task}]{example.prompt.rstrip()} -> {shown}  "
        f"(encoder layers: image {image_layers}, text {text_layers})"
    )


def demo_lines(report: DemoReport) -> list[str]:
    """The demo's report in words, as `hf-earlyexit demo` prints it. A report that grows only adds lines at the
    end, so a caller prints the new ones as `run_demo` yields."""
    return [
        f"Loaded {report.model_dir} with AutoModel/AutoProcessor (trust_remote_code=True): OFA-EE, "
        f"{report.parameters / 1e6:.1f}M parameters, {report.encoder_layers} encoder layers ("
        f"{'image and text streams' if report.decomposed_encoder else 'image and text together'}), "
        f"{report.decoder_layers} decoder layers; calibrated exit defaults {report.knobs}",
        "Each task's test split through the full and the early-exit model, same inputs "
        f"({report.threads} CPU thread{'s' if report.threads != 1 else ''}; about 3 minutes on a 2-core CPU, a "
        "progress bar per task; expected time reductions from the part costs measured in the same rounds):",
        *(task_line(name, task, report.encoder_layers, report.decoder_layers) for name, task in report.tasks.items()),
        *(["Examples (each token with the decoder layer it exited after):"] if report.examples else []),
        *(example_line(example) for example in report.examples),
        *([f"The captions' exit layers, as a picture: {report.picture}"] if report.picture else []),
    ]


__all__ = ["DEMO_EXAMPLES", "DEMO_SAMPLES", "DemoReport", "ExitExample", "demo_lines", "exit_examples", "run_demo"]
