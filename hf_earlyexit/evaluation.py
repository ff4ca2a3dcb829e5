"""Running a task's split through `generate` and scoring it: the predictions, the layers every part ran, the
seconds it took, and the task's metric. What `hf-earlyexit eval`, the calibration and the benchmark are built on.

Exit knobs a call does not give fall back on the model's generation defaults (which calibration writes), so the
full model is asked for explicitly: runs start from `NO_EXIT`, every knob at "no exit".
"""

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .data import CAPTION_PROMPT, ImageTextCollator
from .measures import PartCosts, expected_time_reduction
from .metrics import load as load_metric
from .modeling.exit_controllers import ExitController, FixedLayerExit
from .modeling.exit_knobs import (
    DRAFT_KNOBS,
    DRAFTING_KNOBS,
    ENCODER_PARTS,
    NO_EXIT,
    SPECULATIVE_KNOBS,
    check_drafts_used,
    drafts_with_exit_knobs,
    non_default_knobs,
    resolve_knobs,
    shown_knobs,
)
from .modeling.generation_early_exit import EarlyExitSettings
from .sharding import shared_map
from .tasks import Task, get_task


@dataclass(frozen=True)
class Asks:
    """Where a lossy run asks its controllers. The decoder's: the `layers` (1-based) after which every token is asked
    (the exit points from `min_exit_layer` to `max_exit_layer`), its `policy` ("custom" for a controller object) and
    its `controller`. Each encoder part's with a controller: `encoder_layers` (part -> the layers from
    `encoder_min_exit_layer` to the last but one) and `encoder_controllers`. None in speculative mode (its rounds are
    timed as a whole, and the encoder runs in full)."""

    policy: str | None = None
    controller: ExitController | None = None
    layers: tuple[int, ...] = ()
    encoder_layers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    encoder_controllers: dict[str, ExitController] = field(default_factory=dict)

    @classmethod
    def of(cls, model, knobs: dict[str, Any] | None) -> "Asks":
        """The asks of a run with `knobs` (on top of "no exit")."""
        values = {**NO_EXIT, **(knobs or {})}
        if values["exit_mode"] == "speculative":
            return cls()
        config = model.config
        settings = EarlyExitSettings.from_knobs(config, **values)
        encoder = {part: getattr(settings, part) for part in ENCODER_PARTS}
        encoder = {part: controller for part, controller in encoder.items() if controller is not None}
        encoder_layers = tuple(range(settings.encoder_min_exit_layer, config.encoder_layers))
        asks = cls(encoder_layers=dict.fromkeys(encoder, encoder_layers), encoder_controllers=encoder)
        if settings.decoder is None:
            return asks
        custom = values["exit_controller"]
        custom = custom.get("decoder") if isinstance(custom, dict) else custom
        layers = settings.asked_layers(config.exit_points, config.decoder_layers)
        policy = "custom" if custom is not None else values["exit_policy"]
        return dataclasses.replace(asks, policy=policy, controller=settings.decoder, layers=layers)


def normalize_answer(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".?!").split())


@dataclass
class TaskInputs:
    """A split turned into model inputs once (so timing covers `generate` only): batches and the references."""

    task: Task
    batches: list[dict[str, torch.Tensor]]
    targets: list[str]

    @classmethod
    def build(cls, task: Task, processor, rows, batch_size: int, device: str | torch.device = "cpu") -> "TaskInputs":
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be positive, got {batch_size}.")
        collator = ImageTextCollator(processor, "image", "prompt", "target")
        batches = []
        for start in range(0, len(rows), batch_size):
            batch = collator([rows[index] for index in range(start, min(start + batch_size, len(rows)))])
            batches.append({name: value.to(device) for name, value in batch.items() if name != "labels"})
        return cls(task, batches, list(rows["target"]))

    @property
    def samples(self) -> int:
        return len(self.targets)

    def split_at(self, samples: int) -> tuple["TaskInputs", "TaskInputs"]:
        """The first batches, as many as hold `samples` rows, and the rest (empty when the split is smaller)."""
        size = self.batches[0]["input_ids"].shape[0]
        count = -(-samples // size)
        return (
            TaskInputs(self.task, self.batches[:count], self.targets[: count * size]),
            TaskInputs(self.task, self.batches[count:], self.targets[count * size :]),
        )


def split_task_inputs(
    inputs: TaskInputs, first: int, processor, split: str, device: str | torch.device = "cpu"
) -> tuple[TaskInputs, TaskInputs]:
    """`inputs` (the first rows of `split`) as two: their first `first` rows and the rest, each in batches of the
    same size (the rest empty when there is none)."""
    rows = inputs.task.dataset(split, size=inputs.samples)
    size, first = inputs.batches[0]["input_ids"].shape[0], min(first, len(rows))
    parts = [list(range(first)), list(range(first, len(rows)))]
    return tuple(
        TaskInputs.build(inputs.task, processor, rows.select(part), size, device)
        if part
        else TaskInputs(inputs.task, [], [])
        for part in parts
    )


def task_inputs(
    name: str, processor, split: str, samples: int, batch_size: int, device: str | torch.device = "cpu"
) -> TaskInputs:
    """The first `samples` rows of task `name`'s `split` as model inputs; ValueError on an unknown task or a
    non-positive size."""
    if samples < 1:
        raise ValueError(f"`samples` must be positive, got {samples}.")
    task = get_task(name)
    return TaskInputs.build(task, processor, task.dataset(split, size=samples), batch_size, device)


def run_knobs(model, full: bool = False, **given: Any) -> dict[str, Any]:
    """The exit knobs of a run, knob by knob as `generate` resolves them: `given`, else the model's saved default
    (what calibration wrote), so `kv_strategy="copy"` alone keeps the calibrated thresholds. Knobs at their
    default are left out unless given; `full` means none (the full model). They are checked as `generate` checks
    them, so a bad one fails before any data loads."""
    if full:
        return {}
    resolved = non_default_knobs(resolve_knobs(model.config, model.generation_config, **given))
    if resolved.get("exit_mode") == "speculative":  # it sets aside the saved defaults that would change its output
        set_aside = {*SPECULATIVE_KNOBS, *(DRAFT_KNOBS if drafts_with_exit_knobs(given) else ())}
    else:  # saved drafts serve speculative calls only
        check_drafts_used(resolved.get("exit_mode", "exit"), given)
        set_aside = set(DRAFTING_KNOBS)
    resolved = {name: value for name, value in resolved.items() if name not in set_aside}
    knobs = {**resolved, **given}
    EarlyExitSettings.from_knobs(model.config, model.generation_config, **knobs)
    return knobs


@dataclass
class TaskRun:
    """predictions: one text per sample. encoder_exit_layers [N, 2]: layers run per (image, text) stream.
    decoder_exit_layers [N, T]: layers run per generated token, 0 past the sample's end. seconds: wall clock.
    drafted / accepted / rounds: speculative mode's drafted and accepted tokens and rounds, summed over the rows (0
    otherwise)."""

    predictions: list[str]
    encoder_exit_layers: torch.Tensor
    decoder_exit_layers: torch.Tensor
    seconds: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def tokens(self) -> int:
        """The tokens generated, up to each sample's end."""
        return int((self.decoder_exit_layers > 0).sum())

    @classmethod
    def concatenate(cls, runs: list["TaskRun"]) -> "TaskRun":
        """The runs of consecutive batches as one run (decoder exit layers padded with 0 to the longest)."""
        width = max(run.decoder_exit_layers.shape[1] for run in runs)
        return cls(
            [prediction for run in runs for prediction in run.predictions],
            torch.cat([run.encoder_exit_layers for run in runs]),
            torch.cat([F.pad(run.decoder_exit_layers, (0, width - run.decoder_exit_layers.shape[1])) for run in runs]),
            sum(run.seconds for run in runs),
            sum(run.drafted for run in runs),
            sum(run.accepted for run in runs),
            sum(run.rounds for run in runs),
        )


@torch.no_grad()
def run_batch(
    model, processor, task: Task, batch: dict[str, torch.Tensor], knobs: dict[str, Any] | None = None, **generate_kwargs
) -> TaskRun:
    """Generate for one batch with `knobs` (on top of "no exit"), timing the `generate` call only."""
    settings = {**NO_EXIT, **(knobs or {})}
    decoding = dict(max_new_tokens=task.max_new_tokens, num_beams=task.num_beams, do_sample=False)
    start = time.perf_counter()
    out = model.generate(**batch, **settings, **decoding, **generate_kwargs, return_dict_in_generate=True)
    if out.sequences.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    decoder_layers = out.exit_layers.cpu()  # `generate` gives 0 past each row's end in every decoding mode
    predictions = [text.strip() for text in processor.batch_decode(out.sequences, skip_special_tokens=True)]
    counts = (
        (int(out.drafted_tokens.sum()), int(out.accepted_tokens.sum()), int(out.speculative_rounds.sum()))
        if getattr(out, "drafted_tokens", None) is not None
        else (0, 0, 0)
    )
    return TaskRun(predictions, out.encoder_exit_layers.cpu(), decoder_layers, seconds, *counts)


def run_task(
    model,
    processor,
    inputs: TaskInputs,
    knobs: dict[str, Any] | None = None,
    progress: str | None = None,
    **generate_kwargs,
) -> TaskRun:
    """`run_batch` for every batch of `inputs`, as one run; `progress`: a progress bar's description (None: none).
    Under `accelerate launch`, the processes share the batches and each gets the whole run (`sharding.shared_map`);
    `seconds` is then the sum of the processes' `generate` time."""

    def run(batch: dict[str, torch.Tensor]) -> TaskRun:
        return run_batch(model, processor, inputs.task, batch, knobs, **generate_kwargs)

    return TaskRun.concatenate(shared_map(run, inputs.batches, progress))


def score(
    task: Task, predictions: list[str], targets: list[str], meteor: bool = False, per_sample: bool = False
) -> dict[str, Any]:
    """The task's metric (`task.metric`); METEOR (a Java start-up) only when asked; with `per_sample`, captions'
    CIDEr per sample too (`CIDEr_per_sample`), which the per-sample losses need: a ValueError where the metric cannot
    give them (CIDEr on one image)."""
    metric = load_metric(task.metric)
    if task.metric == "entailment_accuracy":
        return metric.compute(predictions=predictions, references=targets)
    extra = {"meteor": meteor, "per_sample": per_sample} if task.metric == "coco_caption" else {}
    scores = metric.compute(predictions=predictions, references=[[target] for target in targets], **extra)
    if per_sample and scores[task.quality_key] is None:
        raise ValueError(f"{task.name}: {scores[f'{task.quality_key}_unavailable']}")
    return scores


def flop_costs(model, inputs: TaskInputs) -> PartCosts:
    """`PartCosts.from_config` for the lengths of `inputs` (image tokens, the first batch's prompt, new tokens)."""
    first = inputs.batches[0]
    image_tokens = model.get_encoder().embed_image(first["pixel_values"][:1])[0].shape[1]
    return PartCosts.from_config(model.config, image_tokens, first["input_ids"].shape[1], inputs.task.max_new_tokens)


def evaluate_task(
    model,
    processor,
    task: str,
    split: str = "test",
    samples: int = 1000,
    batch_size: int = 32,
    knobs: dict[str, Any] | None = None,
    meteor: bool = False,
    progress: bool = False,
    against_full: bool = False,
) -> dict[str, Any]:
    """Task `task`'s first `samples` rows of `split` through `generate` with `knobs` (on top of "no exit"): the
    scores, the expected time reduction by FLOPs (batch-aware at `batch_size`, and per row) and the seconds. The
    JSON object `hf-earlyexit eval` prints; `progress` shows a bar over the batches. `against_full`: the full model
    runs on the same rows too, and `risk_against_full` is the mean of the task's `risk_loss` against it, the risk a
    `calibrate --risk` certificate bounds (checked here on held-out rows)."""
    inputs = task_inputs(task, processor, split, samples, batch_size, model.device)
    run = run_task(model, processor, inputs, knobs, f"{task} ({inputs.samples} samples)" if progress else None)
    config, costs = model.config, flop_costs(model, inputs)
    scores = score(inputs.task, run.predictions, inputs.targets, meteor=meteor, per_sample=against_full)
    per_sample = scores.pop(f"{inputs.task.quality_key}_per_sample", None)

    def reduction(batch: int) -> float:
        return expected_time_reduction(
            run.encoder_exit_layers, run.decoder_exit_layers, costs, config.encoder_layers, config.decoder_layers, batch
        )

    batch_size = min(batch_size, inputs.samples)  # the rows a call decoded together
    report = {
        "task": inputs.task.name,
        "split": split,
        "samples": inputs.samples,
        "batch_size": batch_size,
        "settings": shown_knobs(knobs or {}),
        "scores": scores,
        "expected_time_reduction_flops": reduction(batch_size),
        "expected_time_reduction_flops_per_row": reduction(1),
        "seconds": run.seconds,
    }
    if (knobs or {}).get("exit_mode") == "speculative":  # the verification runs every layer a draft skipped
        report.update(expected_time_reduction_flops=None, expected_time_reduction_flops_per_row=None)
        report.update(drafted_tokens=run.drafted, accepted_tokens=run.accepted, speculative_rounds=run.rounds)
    if against_full:
        full = run_task(model, processor, inputs, None, "the full model" if progress else None)
        full_scores = score(inputs.task, full.predictions, inputs.targets, per_sample=True)
        losses = risk_losses(
            inputs.task,
            run.predictions,
            per_sample,
            full.predictions,
            full_scores.get(f"{inputs.task.quality_key}_per_sample"),
        )
        report["risk_against_full"] = {"loss": inputs.task.risk_loss, "mean": sum(losses) / len(losses)}
    return report


@torch.no_grad()
def caption_images(
    model,
    processor,
    images: list,
    prompt: str = CAPTION_PROMPT,
    num_beams: int = 5,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    progress: bool = False,
    **knobs: Any,
) -> tuple[list[str], float]:
    """The captions of `images` (without OFA's leading space) in batches of `batch_size` (with the model's saved exit
    defaults, and `knobs` over them) and the seconds `generate` took; `progress` shows a bar over the batches.
    ValueError on a batch size or a beam count below 1."""
    from tqdm.auto import tqdm

    if batch_size < 1 or num_beams < 1:
        raise ValueError(f"`batch_size` and `num_beams` must be positive, got {batch_size} and {num_beams}.")
    captions, seconds = [], 0.0
    for start in tqdm(range(0, len(images), batch_size), desc="captioning", disable=not progress):
        batch = images[start : start + batch_size]
        inputs = processor(images=batch, text=[prompt] * len(batch), return_tensors="pt")
        began = time.perf_counter()
        sequences = model.generate(**inputs, num_beams=num_beams, max_new_tokens=max_new_tokens, **knobs)
        seconds += time.perf_counter() - began
        captions += [caption.strip() for caption in processor.batch_decode(sequences, skip_special_tokens=True)]
    return captions, seconds


def risk_losses(
    task: Task,
    predictions: list[str],
    sample_scores: list[float] | None,
    reference_predictions: list[str],
    reference_scores: list[float] | None,
) -> list[float]:
    """Per sample, the task's `risk_loss` against the reference (the full model's) outputs: 1 where an answer
    differs ("binary"), or a caption's relative drop of its per-sample score ("bounded")."""
    if task.risk_loss == "bounded":
        return relative_drop(sample_scores, reference_scores)
    return disagreement(predictions, reference_predictions)


def relative_drop(scores: list[float], reference_scores: list[float]) -> list[float]:
    """Per sample, how much of the full model's score was lost, (reference - score) / reference clipped to [0, 1]
    (0 where the reference scored 0: nothing to lose): the bounded loss Learn then Test controls for captions, whose
    mean tracks the relative CIDEr drop."""
    return [
        min(1.0, max(0.0, (reference - value) / reference)) if reference > 0 else 0.0
        for value, reference in zip(scores, reference_scores, strict=True)
    ]


def disagreement(predictions: list[str], reference_predictions: list[str]) -> list[float]:
    """Per sample, 1.0 where the answer differs from the full model's (normalised): the loss Learn then Test
    controls."""
    return [
        float(normalize_answer(a) != normalize_answer(b))
        for a, b in zip(predictions, reference_predictions, strict=True)
    ]


@torch.no_grad()
def exit_layer_accuracy(
    model,
    processor,
    dataset,
    image_column: str = "image",
    text_column: str | None = "question",
    target_column: str = "answer",
    prompt: str = CAPTION_PROMPT,
    batch_size: int = 64,
    max_new_tokens: int = 4,
) -> dict[int, float]:
    """Greedy answers with every token exiting after layer k, for each exit point k and the full model (the last
    layer): the fraction equal to the target (lower-cased, stripped). Keys are 1-based decoder layers."""
    model.eval()
    layers = [*model.config.exit_points, model.config.decoder_layers]
    correct = dict.fromkeys(layers, 0)
    collator = ImageTextCollator(processor, image_column, text_column, target_column, prompt)
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[index] for index in range(start, min(start + batch_size, len(dataset)))]
        inputs = {name: value.to(model.device) for name, value in collator(rows).items() if name != "labels"}
        targets = [normalize_answer(row[target_column]) for row in rows]
        for layer in layers:
            knobs = {"exit_controller": FixedLayerExit(layer)} if layer < model.config.decoder_layers else {}
            sequences = model.generate(
                **inputs, **{**NO_EXIT, **knobs}, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
            )
            answers = processor.batch_decode(sequences, skip_special_tokens=True)
            correct[layer] += sum(normalize_answer(a) == t for a, t in zip(answers, targets, strict=True))
    return {layer: count / len(dataset) for layer, count in correct.items()}


__all__ = [
    "Asks",
    "TaskInputs",
    "TaskRun",
    "caption_images",
    "disagreement",
    "evaluate_task",
    "relative_drop",
    "risk_losses",
    "exit_layer_accuracy",
    "flop_costs",
    "normalize_answer",
    "run_batch",
    "run_knobs",
    "run_task",
    "score",
    "task_inputs",
]
