"""Choosing speculative mode's drafts by the clock: which decoder exit drafts (`draft_exit_policy`,
`draft_exit_threshold`), how many tokens a round drafts (`num_assistant_tokens`, `num_assistant_tokens_schedule`), and
up to which batch size drafting pays (`draft_max_batch_size`: a step costs about its deepest row, so larger batches
gain less from shallow drafts). On request, the drafts propose only the tokens the references use most
(`draft_vocabulary`, `frequent_tokens`).

Speculative mode's output is the full model's whatever drafts it, so there is no quality to trade: the choice is the
setting with the most tokens per second, timed beside the full model on the same batches. Lower thresholds than
lossy exits can afford pay here (a poor draft costs one rejected token, not a wrong answer). `calibrate_drafts` is
the run behind `hf-earlyexit calibrate --exit-mode speculative`.
"""

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .benchmark import paired_seconds, timed_on
from .calibration import settings_key, write_generation_defaults, write_together
from .evaluation import TaskInputs, TaskRun, run_batch, task_inputs
from .modeling.generation_early_exit import check_draft_length
from .modeling.processing_ofa import prompt_text

# The default grid: lower thresholds than `calibration.DECODER_THRESHOLDS`, since a draft only has to be right
# often enough, and fixed layers, which draft without scoring anything. On the embedded model confidence 0.2-0.4
# drafted fastest among the scores, and a fixed layer 1 about 3% faster still at batch 1 (2026-12-07); similarity
# drafts (0.9, 0.95) never beat the full model on VQA or entailment there, so they are timed only on request.
DRAFT_THRESHOLDS = {"confidence": (0.2, 0.4, 0.6), "fixed_layer": (1, 2)}
DRAFT_TOKENS = (4, 8)
# "heuristic" (Transformers' rule: two more drafts after a round that accepted all, one fewer otherwise) measured
# +3% on captions at batch 1 and -1% at batch 8 against the constant 4 (2026-12-07): the clock decides.
DRAFT_LENGTH_SCHEDULES = ("constant", "heuristic")
DRAFT_LENGTH = "num_assistant_tokens"  # Transformers' own fields for an assistant's draft length and its schedule
DRAFT_SCHEDULE = "num_assistant_tokens_schedule"
# The settings within this fraction of the best at the calibration's batch size are timed at the larger batch sizes
# too. On the embedded model at batch 1 the four best were within 0.6% of each other, while at batch 8 four drafts
# per round beat eight by 13% on captions (2026-11-25).
CONTENDER_MARGIN = 0.97


@dataclass
class DraftingPoint:
    """One drafting setting timed on a task against the full model.

    settings: `generate` kwargs (`draft_exit_policy`, `draft_exit_threshold`, `num_assistant_tokens`,
        `num_assistant_tokens_schedule`).
    seconds / full_seconds: the split's wall clock in speculative mode and the full model's, paired per batch.
    tokens / full_tokens: the tokens it and the full model generated. same_outputs: whether every output is the full
        model's (it must be).
    drafted / accepted / rounds: speculative mode's statistics, summed over the samples.
    """

    settings: dict[str, Any]
    seconds: float
    full_seconds: float
    tokens: int
    full_tokens: int
    same_outputs: bool
    drafted: int
    accepted: int
    rounds: int

    @property
    def speedup(self) -> float:
        """The full model's seconds over this setting's: its tokens per second relative to the full model's."""
        return self.full_seconds / self.seconds

    def report(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "speedup_over_full": round(self.speedup, 3),
            "tokens_per_second": round(self.tokens / self.seconds, 2),
            "same_outputs_as_full": self.same_outputs,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "tokens_per_round": round(self.tokens / self.rounds, 3) if self.rounds else None,
        }


def check_draft_lengths(draft_tokens: Sequence[int], schedules: Sequence[str] = ("constant",)) -> None:
    """ValueError unless `draft_tokens` are one or more positive integers and `schedules` one or more of
    `num_assistant_tokens_schedule`'s values."""
    if not draft_tokens or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in draft_tokens):
        raise ValueError(f"Draft lengths (`num_assistant_tokens`) must be positive integers, got {list(draft_tokens)}.")
    if not schedules:
        raise ValueError("Give at least one draft length schedule (`num_assistant_tokens_schedule`).")
    for schedule in schedules:
        check_draft_length(None, schedule)


def drafting_grid(
    thresholds: dict[str, Sequence[float]] = DRAFT_THRESHOLDS,
    draft_tokens: Sequence[int] = DRAFT_TOKENS,
    schedules: Sequence[str] = DRAFT_LENGTH_SCHEDULES,
) -> list[dict[str, Any]]:
    """Every (policy, threshold) x draft length x its schedule as `generate` kwargs; ValueError on a draft length
    below 1 or an unknown schedule."""
    check_draft_lengths(draft_tokens, schedules)
    return [
        {"draft_exit_policy": policy, "draft_exit_threshold": threshold, DRAFT_LENGTH: k, DRAFT_SCHEDULE: schedule}
        for policy, values in thresholds.items()
        for threshold in values
        for k in draft_tokens
        for schedule in schedules
    ]


def reference_tokens(processor, targets: Sequence[str | list[str]]) -> list[int]:
    """Every token of the references `targets` (a string, or several per sample), tokenized as training labels them:
    after the start token, which the decoder is fed and never drafts, so each holds the end token once."""
    texts = [prompt_text(text) for target in targets for text in ([target] if isinstance(target, str) else target)]
    return [token for ids in processor.tokenizer(texts)["input_ids"] for token in ids[1:]]


def frequent_tokens(processor, targets: Sequence[str | list[str]], size: int) -> list[int]:
    """A draft vocabulary (FR-Spec): the `size` token ids most frequent in the references `targets`
    (`reference_tokens`), most frequent first, ties by id."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"The draft vocabulary's size must be a positive integer, got {size!r}.")
    counts = Counter(reference_tokens(processor, targets))
    return [token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]]


def time_drafts(
    model,
    processor,
    inputs,
    grid: Sequence[dict[str, Any]],
    repeats: int = 2,
    progress: bool = True,
    vocabulary: Sequence[int] | None = None,
) -> list[DraftingPoint]:
    """Each setting of `grid` in speculative mode, its drafts proposing tokens of `vocabulary` only (None: any), and
    the full model on the same batches, every one back to back per batch (`benchmark.paired_seconds`, so a shared
    machine's drift stays out of the ratios)."""
    # Drafting at every batch size, whatever `draft_max_batch_size` the model has saved: the drafts are what is timed.
    drafting = {"exit_mode": "speculative", "draft_max_batch_size": None, "draft_vocabulary": vocabulary}
    settings = {"full": {}} | {json.dumps(knobs): drafting | knobs for knobs in grid}
    runs: dict[str, list[TaskRun | None]] = {name: [None] * len(inputs.batches) for name in settings}

    def timed(name: str):
        def run(index: int) -> None:
            runs[name][index] = run_batch(model, processor, inputs.task, inputs.batches[index], settings[name])

        return run

    progress_bar = f"timing drafts on {inputs.task.name}" if progress else None
    functions = {name: timed(name) for name in settings}
    seconds = paired_seconds(functions, len(inputs.batches), repeats, model.device, progress_bar)
    whole = {name: TaskRun.concatenate(batch_runs) for name, batch_runs in runs.items()}
    full = whole.pop("full")
    return [
        DraftingPoint(
            settings=json.loads(name),
            seconds=seconds[name],
            full_seconds=seconds["full"],
            tokens=run.tokens,
            full_tokens=full.tokens,
            same_outputs=run.predictions == full.predictions,
            drafted=run.drafted,
            accepted=run.accepted,
            rounds=run.rounds,
        )
        for name, run in whole.items()
    ]


def setting_scores(timings: dict[str, Sequence[DraftingPoint]]) -> dict[str, float]:
    """Each setting's geometric-mean speedup over the tasks (keyed by its JSON), for the settings that gave the full
    model's outputs and were at least as fast as the full model on every task."""
    by_setting: dict[str, list[DraftingPoint]] = {}
    for points in timings.values():
        for point in points:
            if point.same_outputs and point.speedup >= 1:
                by_setting.setdefault(settings_key(point.settings), []).append(point)
    return {
        key: math.exp(sum(math.log(point.speedup) for point in points) / len(points))
        for key, points in by_setting.items()
        if len(points) == len(timings)
    }


def fastest_drafts(timings: dict[str, Sequence[DraftingPoint]]) -> dict[str, Any] | None:
    """One drafting setting for several tasks: among those that gave the full model's outputs and were at least as
    fast as the full model on every task, the one with the largest geometric-mean speedup; None if none was."""
    scores = setting_scores(timings)
    return json.loads(max(scores, key=scores.__getitem__)) if scores else None


def contenders(timings: dict[str, Sequence[DraftingPoint]], margin: float = CONTENDER_MARGIN) -> list[dict[str, Any]]:
    """The settings `fastest_drafts` could choose whose score is within `margin` of the best one's, best first:
    alike at this batch size, they may differ at larger ones."""
    scores = setting_scores(timings)
    best = max(scores.values(), default=0.0)
    ranked = sorted(scores, key=scores.__getitem__, reverse=True)
    return [json.loads(key) for key in ranked if scores[key] >= margin * best]


def largest_paying_batch_size(speedups: dict[int, dict[str, float]]) -> int:
    """The largest batch size up to which the drafts were at least as fast as the full model on every task, from
    the speedups per batch size (in any order) per task, the smallest size first; its smallest size if it lost."""
    sizes = sorted(speedups)
    largest = sizes[0]
    for size in sizes[1:] if all(speedup >= 1 for speedup in speedups[largest].values()) else []:
        if min(speedups[size].values()) < 1:
            break
        largest = size
    return largest


def served_speedup(speedups: dict[int, dict[str, float]]) -> float:
    """What a setting gives over the batch sizes it was timed at, from its speedups per batch size per task: the
    geometric mean over sizes and tasks of its speedup up to its `largest_paying_batch_size`, and 1 above it, where
    the full model decodes."""
    limit = largest_paying_batch_size(speedups)
    served = [value if size <= limit else 1.0 for size, tasks in speedups.items() for value in tasks.values()]
    if min(served) <= 0:  # it changed an output
        return 0.0
    return math.exp(sum(math.log(value) for value in served) / len(served))


def write_drafting_defaults(model, settings: dict[str, Any]) -> None:
    """Make `settings` speculative mode's saved drafts: the draft knobs, `num_assistant_tokens` and
    `num_assistant_tokens_schedule` go to the generation config (the lossy exit defaults and `exit_mode` stay as
    they are). ValueError on a bad value."""
    check_draft_length(settings.get(DRAFT_LENGTH), settings.get(DRAFT_SCHEDULE))
    lengths = {name: settings[name] for name in (DRAFT_LENGTH, DRAFT_SCHEDULE) if settings.get(name) is not None}
    write_generation_defaults(model, {name: value for name, value in settings.items() if name not in lengths})
    for name, value in lengths.items():
        setattr(model.generation_config, name, value)


def check_batch_sizes(batch_size: int, batch_sizes: Sequence[int]) -> None:
    """ValueError unless the batch sizes to time the chosen drafts at are integers above `batch_size`."""
    if any(isinstance(size, bool) or not isinstance(size, int) or size <= batch_size for size in batch_sizes):
        raise ValueError(
            f"The batch sizes to time the chosen drafts at must be integers above the calibration's batch size "
            f"({batch_size}), got {list(batch_sizes)}."
        )


def speedups_by_size(timings: dict[int, dict[str, Sequence[DraftingPoint]]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per setting (its key), per batch size, per task: its speedup over the full model, 0 where it changed an output
    (so that it never pays there)."""
    speedups: dict[str, dict[int, dict[str, float]]] = {}
    for size, by_task in timings.items():
        for name, points in by_task.items():
            for point in points:
                speedup = point.speedup if point.same_outputs else 0.0
                speedups.setdefault(settings_key(point.settings), {}).setdefault(size, {})[name] = speedup
    return speedups


def choose_for_batch_sizes(
    timings: dict[int, dict[str, Sequence[DraftingPoint]]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The setting with the largest `served_speedup` over the batch sizes of `timings` (size -> task -> points of
    the same settings), with its `draft_max_batch_size`; and the report of the choice: every setting's speedups,
    and per larger batch size and task the chosen setting's point."""
    speedups = speedups_by_size(timings)
    served = {key: served_speedup(by_size) for key, by_size in speedups.items()}
    ranked = sorted(served, key=served.__getitem__, reverse=True)
    best, smallest = ranked[0], min(timings)
    limit = largest_paying_batch_size(speedups[best])
    report = {
        "contenders": [
            {
                "settings": json.loads(key),
                "served_speedup": round(served[key], 3),
                "draft_max_batch_size": largest_paying_batch_size(speedups[key]),
                "speedups": {
                    size: {name: round(x, 3) for name, x in by_task.items()} for size, by_task in speedups[key].items()
                },
            }
            for key in ranked
        ],
        "batch_sizes": {
            size: {
                name: next(p for p in points if settings_key(p.settings) == best).report()
                for name, points in by_task.items()
            }
            for size, by_task in timings.items()
            if size != smallest
        },
        "draft_max_batch_size": limit,
    }
    return json.loads(best) | {"draft_max_batch_size": limit}, report


def time_at_batch_sizes(
    model,
    processor,
    tasks: Sequence[str],
    split: str,
    samples: int,
    batch_sizes: Sequence[int],
    grid: Sequence[dict[str, Any]],
    repeats: int,
    progress: bool,
    vocabulary: Sequence[int] | None = None,
) -> dict[int, dict[str, list[DraftingPoint]]]:
    """`time_drafts` of `grid` on each task at each of `batch_sizes`: size -> task -> points."""
    return {
        size: {
            name: time_drafts(
                model, processor, task_inputs(name, processor, split, samples, size, model.device), grid, repeats,
                progress, vocabulary,
            )
            for name in tasks
        }
        for size in sorted(batch_sizes)
    }  # fmt: skip


def calibrate_drafts(
    model,
    processor,
    tasks: Sequence[str],
    split: str = "validation",
    samples: int = 64,
    batch_size: int = 1,
    thresholds: dict[str, Sequence[float]] = DRAFT_THRESHOLDS,
    draft_tokens: Sequence[int] = DRAFT_TOKENS,
    repeats: int = 2,
    write_to: str | Path | None = None,
    progress: bool = True,
    batch_sizes: Sequence[int] = (),
    vocabulary_size: int | None = None,
    schedules: Sequence[str] = DRAFT_LENGTH_SCHEDULES,
) -> dict[str, Any]:
    """Time every drafting setting of `thresholds` (per policy; the fixed_layer policy's are layers) x `draft_tokens`
    x their `schedules` on each task's first `samples` rows of `split` in batches of `batch_size` (the choice is for
    that batch size: speculative mode pays most at batch 1), and choose the fastest on every task (`fastest_drafts`).
    Returns the JSON report `hf-earlyexit calibrate --exit-mode speculative` prints: per task the full model's tokens
    per second and every setting's point, fastest first.

    batch_sizes: larger batch sizes to time the `contenders` at, beside the full model (settings alike at
        `batch_size` may differ there: each draft step costs the whole batch, and the verification grows with the
        drafts, so a shorter draft budget can pay more). The choice is
        then the contender with the largest `served_speedup` over all the sizes, and `draft_max_batch_size` the
        largest size up to which it was never slower on any task (`largest_paying_batch_size`): calls with more rows
        decode with the full model.

    Without `batch_sizes`, the choice's `draft_max_batch_size` is `batch_size`: drafts are known to pay up to there.

    vocabulary_size: every setting drafts from the `frequent_tokens` of this size in the tasks' references on
        `split`; the report's `draft_vocabulary` gives their ids, how many (fewer than requested when the references
        hold fewer distinct tokens), and the share of the references' tokens they cover per task, and the choice is
        saved with them. None: drafts score every token.

    write_to: the model's folder, where the choice is saved (`save_drafting_calibration`); ValueError, and nothing
        written, when no setting was at least as fast as the full model on every task.
    """
    grid = drafting_grid(thresholds, draft_tokens, schedules)
    if not grid:
        raise ValueError("No drafting setting to time: give at least one policy with a threshold.")
    check_batch_sizes(batch_size, batch_sizes)
    report: dict[str, Any] = {
        "exit_mode": "speculative",
        "split": split,
        "batch_size": batch_size,
        **timed_on(model),  # drafts pay by the clock of this device: another machine calibrates its own
        "repeats": repeats,
        "points": len(grid),
        "tasks": {},
    }
    inputs = {name: task_inputs(name, processor, split, samples, batch_size, model.device) for name in tasks}
    vocabulary = None
    if vocabulary_size is not None:
        vocabulary = frequent_tokens(processor, [t for task in inputs.values() for t in task.targets], vocabulary_size)
        # Its "size" falls short of "requested" where the references hold fewer distinct tokens.
        summary = vocabulary_report(processor, inputs.values(), vocabulary)
        report["draft_vocabulary"] = {"requested": vocabulary_size, **summary}
    timings = {}
    for name in tasks:
        timings[name] = time_drafts(model, processor, inputs[name], grid, repeats, progress, vocabulary)
        first = timings[name][0]  # every point carries the full model's run, timed beside it
        report["tasks"][name] = {
            "full_seconds": round(first.full_seconds, 4),
            "full_tokens_per_second": round(first.full_tokens / first.full_seconds, 2),
            "points": [point.report() for point in sorted(timings[name], key=lambda p: -p.speedup)],
        }
    chosen = fastest_drafts(timings)
    if chosen is not None and batch_sizes:
        candidates = contenders(timings)
        shortlist = {name: [p for p in points if p.settings in candidates] for name, points in timings.items()}
        larger = time_at_batch_sizes(
            model, processor, tasks, split, samples, batch_sizes, candidates, repeats, progress, vocabulary
        )
        chosen, choice = choose_for_batch_sizes({batch_size: shortlist} | larger)
        report |= choice
    elif chosen is not None:  # timed at `batch_size` only: drafting pays up to there, as far as anyone measured
        chosen = {**chosen, "draft_max_batch_size": batch_size}
    report["chosen"] = chosen
    drafts = (
        None if chosen is None else {name: value for name, value in chosen.items() if name != "draft_max_batch_size"}
    )
    for name, points in timings.items():
        point = next((p for p in points if p.settings == drafts), None)
        report["tasks"][name]["chosen"] = None if point is None else point.report()
    if write_to is not None:
        report["written_to"] = save_drafting_calibration(model, report, write_to)
    return report


def vocabulary_report(processor, inputs: Sequence[TaskInputs], vocabulary: list[int]) -> dict[str, Any]:
    """A draft vocabulary's size, the share of the references' tokens it holds per task, and its token ids."""
    kept = set(vocabulary)
    coverage = {}
    for task in inputs:
        tokens = reference_tokens(processor, task.targets)
        coverage[task.task.name] = round(sum(token in kept for token in tokens) / len(tokens), 4)
    return {"size": len(vocabulary), "coverage": coverage, "token_ids": vocabulary}


def no_drafts_chosen(report: dict[str, Any]) -> str:
    """Why a `calibrate_drafts` report chose nothing."""
    return f"No drafting setting was as fast as the full model on every task at batch size {report['batch_size']}"


def save_drafting_calibration(model, report: dict[str, Any], folder: str | Path) -> str:
    """Save a `calibrate_drafts` report's choice as the model's speculative defaults in `folder`
    (`write_drafting_defaults`, then generation_config.json; with the report's draft vocabulary, or none) and the
    report as calibration_speculative.json; returns the generation config's path. ValueError, and nothing written,
    when nothing was chosen."""
    if report["chosen"] is None:
        raise ValueError(f"{no_drafts_chosen(report)}: nothing written.")
    vocabulary = report.get("draft_vocabulary")
    write_drafting_defaults(model, {**report["chosen"], "draft_vocabulary": vocabulary and vocabulary["token_ids"]})
    write_together(folder, {"calibration_speculative.json": report}, model.generation_config)
    return str(Path(folder, "generation_config.json"))


__all__ = [
    "CONTENDER_MARGIN",
    "DRAFT_LENGTH_SCHEDULES",
    "DRAFT_THRESHOLDS",
    "DRAFT_TOKENS",
    "DraftingPoint",
    "calibrate_drafts",
    "no_drafts_chosen",
    "save_drafting_calibration",
    "choose_for_batch_sizes",
    "contenders",
    "drafting_grid",
    "fastest_drafts",
    "frequent_tokens",
    "largest_paying_batch_size",
    "served_speedup",
    "time_drafts",
    "write_drafting_defaults",
]
