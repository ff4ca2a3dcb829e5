"""Choosing exit thresholds from a sweep: the Pareto frontier of quality vs expected time reduction, the fastest
setting within a quality tolerance of the full model, and the same choice with a statistical guarantee
(Learn then Test, Angelopoulos et al. 2021: fixed-sequence testing with Hoeffding p-values, as CALM does).

`sweep` evaluates each candidate setting of a grid on a calibration split and records an `OperatingPoint`; the
choosing functions only choose among points, so they are exact on any score table. `calibrate` is the whole run
behind `hf-earlyexit calibrate`: sweep every task, choose one setting for all, and save it as the model's defaults.
"""

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmark import measure_part_costs
from .evaluation import TaskInputs, disagreement, run_task, score, task_inputs
from .measures import PartCosts, expected_time_reduction
from .modeling.exit_knobs import ENCODER_PARTS, EXIT_KNOBS
from .modeling.generation_early_exit import EarlyExitSettings

# The default grid: the decoder's policies with their thresholds, and the encoder streams' similarity thresholds.
# The encoder's reach down to 0.9: on the embedded model a stream's layer-2 output is 0.88-0.94 similar to its
# input, so a grid starting at 0.95 never let a stream stop before layer 3.
DECODER_THRESHOLDS = {"similarity": (0.95, 0.98), "confidence": (0.6, 0.8, 0.9, 0.95)}
ENCODER_THRESHOLDS = (0.9, 0.93, 0.95, 0.98)


@dataclass
class OperatingPoint:
    """One evaluated setting.

    settings: the `generate` knobs (e.g. {"exit_threshold": 0.9, "encoder_text_exit_threshold": 0.99}).
    quality: the task metric on the calibration split (higher is better).
    expected_time_reduction: 1 - (cost-weighted layers run) / (the full model's), in [0, 1), batch-aware at the
        batch size the point was evaluated with (a step costs its deepest row).
    seconds: measured wall-clock of the split, when timed.
    sample_losses: per sample, a loss in [0, 1] against the full model (e.g. 1 if the answer differs); what Learn
        then Test controls.
    predictions: the outputs, when the point came from a `sweep`.
    shallowest_encoder_exit: the fewest encoder layers any sample's image or text ran, when it came from a `sweep`.
    per_row_time_reduction: the same counting each row's own layers (the papers' figure), from a `sweep`.
    """

    settings: dict[str, Any]
    quality: float
    expected_time_reduction: float
    seconds: float | None = None
    sample_losses: list[float] | None = field(default=None, repr=False)
    predictions: list[str] | None = field(default=None, repr=False)
    shallowest_encoder_exit: int | None = None
    per_row_time_reduction: float | None = None


def pareto_frontier(points: Sequence[OperatingPoint]) -> list[OperatingPoint]:
    """The points no other point beats on both quality and expected time reduction, fastest first."""
    frontier: list[OperatingPoint] = []
    for point in sorted(points, key=lambda p: (-p.expected_time_reduction, -p.quality)):
        if not frontier or point.quality > frontier[-1].quality:
            frontier.append(point)
    return frontier


def fastest_within_tolerance(
    points: Sequence[OperatingPoint], full_quality: float, tolerance: float = 0.01
) -> OperatingPoint | None:
    """The point with the largest expected time reduction whose quality is at least (1 - tolerance) x the full
    model's (ties: the higher quality); None if no point qualifies."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"`tolerance` must lie in [0, 1), got {tolerance}.")
    eligible = [p for p in points if p.quality >= (1 - tolerance) * full_quality]
    return max(eligible, key=lambda p: (p.expected_time_reduction, p.quality), default=None)


def hoeffding_p_value(mean_loss: float, samples: int, risk_level: float) -> float:
    """p-value of "the expected loss exceeds `risk_level`" given an empirical mean of losses in [0, 1]."""
    if mean_loss >= risk_level:
        return 1.0
    return math.exp(-2 * samples * (risk_level - mean_loss) ** 2)


def learn_then_test(
    points: Sequence[OperatingPoint], risk_level: float = 0.01, delta: float = 0.1
) -> OperatingPoint | None:
    """Learn then Test with fixed-sequence testing: walk the points from the least to the most aggressive (by
    expected time reduction), keep going while each rejects "expected loss > `risk_level`" at level `delta`, and
    return the last one that did. With probability at least 1 - delta over the calibration split, the returned
    setting's expected loss on new data from the same distribution is at most `risk_level`. None if even the most
    conservative point fails."""
    if not 0 < risk_level < 1 or not 0 < delta < 1:
        raise ValueError(f"`risk_level` and `delta` must lie in (0, 1), got {risk_level} and {delta}.")
    chosen = None
    for point in sorted(points, key=lambda p: p.expected_time_reduction):
        if not point.sample_losses:
            raise ValueError(f"Learn then Test needs per-sample losses; the point {point.settings} has none.")
        losses = point.sample_losses
        if any(not 0 <= loss <= 1 for loss in losses):
            raise ValueError(f"Per-sample losses must lie in [0, 1]; the point {point.settings} has others.")
        if hoeffding_p_value(sum(losses) / len(losses), len(losses), risk_level) > delta:
            break
        chosen = point
    return chosen


def calibration_grid(
    config,
    decoder_thresholds: dict[str, Sequence[float]] = DECODER_THRESHOLDS,
    encoder_thresholds: Sequence[float] = ENCODER_THRESHOLDS,
    batch_rules: Sequence[dict[str, Any]] = ({},),
) -> list[dict[str, Any]]:
    """Every combination of a decoder setting (no exit, or a policy with a threshold under each of the decoder's
    `batch_rules`, e.g. {"exit_token_layer": "batch"}) and an encoder setting per stream (no exit, or a similarity
    threshold), as `generate` knobs; the all-"no exit" point is left out."""
    decoder = [{}] + [
        {"exit_policy": policy, "exit_threshold": threshold, **rule}
        for policy, thresholds in decoder_thresholds.items()
        for threshold in thresholds
        for rule in batch_rules
    ]
    streams = ("encoder_image", "encoder_text") if config.decompose_encoder_modalities else ("encoder",)
    per_stream = [[None, *encoder_thresholds]] * len(streams)
    grid = []
    for knobs, thresholds in itertools.product(decoder, itertools.product(*per_stream)):
        encoder = {f"{part}_exit_threshold": t for part, t in zip(streams, thresholds, strict=True) if t is not None}
        if knobs or encoder:
            grid.append({**knobs, **encoder})
    return grid


def sweep(
    model, processor, inputs: TaskInputs, grid: Sequence[dict[str, Any]], costs: PartCosts, progress: bool = True
) -> tuple[OperatingPoint, list[OperatingPoint]]:
    """The full model and every setting of `grid` on `inputs`: quality, expected time reduction (with `costs`),
    seconds, and per sample whether the answer differs from the full model's (the Learn-then-Test loss)."""
    from tqdm.auto import tqdm

    config, batch_size = model.config, inputs.batches[0]["input_ids"].shape[0]

    def evaluate(knobs: dict[str, Any], reference: list[str] | None) -> OperatingPoint:
        run = run_task(model, processor, inputs, knobs)
        encoder_layers_run = run.encoder_exit_layers[run.encoder_exit_layers > 0]  # 0: a modality the input lacks
        layers = (run.encoder_exit_layers, run.decoder_exit_layers, costs, config.encoder_layers, config.decoder_layers)
        return OperatingPoint(
            settings=knobs,
            quality=score(inputs.task, run.predictions, inputs.targets)[inputs.task.quality_key],
            expected_time_reduction=expected_time_reduction(*layers, batch_size),
            seconds=run.seconds,
            sample_losses=disagreement(run.predictions, reference if reference is not None else run.predictions),
            predictions=run.predictions,
            shallowest_encoder_exit=int(encoder_layers_run.min()) if encoder_layers_run.numel() else None,
            per_row_time_reduction=expected_time_reduction(*layers),
        )

    full = evaluate({}, None)
    points = [
        evaluate(knobs, full.predictions)
        for knobs in tqdm(grid, desc=f"calibrating {inputs.task.name}", disable=not progress)
    ]
    return full, points


def fastest_for_every_task(
    sweeps: dict[str, tuple[OperatingPoint, Sequence[OperatingPoint]]], tolerance: float = 0.01
) -> dict[str, Any] | None:
    """One setting for several tasks: among the settings every task's sweep evaluated, those within `tolerance` of
    the full model on every task, the one with the largest mean expected time reduction (None if none is)."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"`tolerance` must lie in [0, 1), got {tolerance}.")
    by_setting: dict[str, list[OperatingPoint]] = {}
    for full, points in sweeps.values():
        for point in points:
            if point.quality >= (1 - tolerance) * full.quality:
                by_setting.setdefault(json.dumps(point.settings, sort_keys=True), []).append(point)
    complete = {key: points for key, points in by_setting.items() if len(points) == len(sweeps)}
    best = max(
        complete.items(),
        key=lambda item: sum(p.expected_time_reduction for p in item[1]) / len(item[1]),
        default=None,
    )
    return None if best is None else json.loads(best[0])


def with_encoder_min_exit_layer(settings: dict[str, Any], points: Sequence[OperatingPoint]) -> dict[str, Any]:
    """`settings` plus `encoder_min_exit_layer`, the shallowest encoder exit in `points` (`settings` swept on each
    task): no exit test below it stopped a calibration sample, so skipping those tests changes nothing there and
    saves their time. `settings` unchanged when it has no encoder exit."""
    if not any(f"{part}_exit_threshold" in settings for part in ENCODER_PARTS):
        return settings
    shallowest = [point.shallowest_encoder_exit for point in points if point.shallowest_encoder_exit is not None]
    if len(shallowest) != len(points):
        raise ValueError("Every point needs the shallowest encoder exit of its sweep.")
    return {**settings, "encoder_min_exit_layer": min(shallowest)}


def write_generation_defaults(model, settings: dict[str, Any]) -> None:
    """Make `settings` the model's exit defaults: they go to its generation config, which `save_pretrained` keeps,
    so a plain `generate` (also as remote code, without this package) exits this way. Raises ValueError on a
    knob that is unknown, invalid for the model, or not a JSON scalar (a controller object cannot be saved)."""
    scalars = (str, int, float, bool, type(None))
    if "exit_controller" in settings or any(not isinstance(value, scalars) for value in settings.values()):
        raise ValueError(f"Only scalar knobs can be saved as generation defaults, got {settings}.")
    EarlyExitSettings.from_knobs(model.config, **settings)  # validates names and values against the model
    for name in EXIT_KNOBS:
        if name in settings:
            setattr(model.generation_config, name, settings[name])
    # A generation config marked as derived from the model config is rebuilt from it on load, losing the knobs.
    model.generation_config._from_model_config = False


# Per task: the full model's point and the grid's.
Sweeps = dict[str, tuple[OperatingPoint, list[OperatingPoint]]]


def calibrate(
    model,
    processor,
    tasks: Sequence[str],
    split: str = "validation",
    samples: int = 300,
    batch_size: int = 64,
    tolerance: float = 0.01,
    delta: float = 0.1,
    decoder_thresholds: dict[str, Sequence[float]] = DECODER_THRESHOLDS,
    encoder_thresholds: Sequence[float] = ENCODER_THRESHOLDS,
    batch_rules: Sequence[dict[str, Any]] = ({},),
    plot: Callable[[Sweeps, dict[str, Any] | None], Path] | None = None,
    write_to: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Sweep the grid of `decoder_thresholds` x `batch_rules` x `encoder_thresholds` on each task's first `samples`
    rows of `split`
    in batches of `batch_size` and choose the fastest setting (by the batch-aware expected time reduction) within
    `tolerance` of the full model on every task (with the shallowest encoder exit seen as `encoder_min_exit_layer`).
    Returns the JSON report `hf-earlyexit calibrate` prints: per task the full quality, the Pareto frontier, the
    Learn-then-Test choice at level `delta` and the chosen setting's point.

    plot: draws the sweeps with the chosen setting and returns the file, e.g.
        `lambda sweeps, chosen: plots.tradeoff_plot(sweeps, path, chosen)` (a callable: `plots` imports this module).
    write_to: the model's folder, where the choice is saved as its generation defaults and the report as
        calibration.json; ValueError, and nothing written, when no setting is within `tolerance` on every task.
    """
    grid = calibration_grid(model.config, decoder_thresholds, encoder_thresholds, batch_rules)
    # The time reductions are batch-aware, so the choice is for this batch size.
    report: dict[str, Any] = {
        "split": split,
        "batch_size": batch_size,
        "tolerance": tolerance,
        "points": len(grid),
        "tasks": {},
    }
    sweeps: Sweeps = {}
    for name in tasks:
        inputs = task_inputs(name, processor, split, samples, batch_size)
        sweeps[name] = sweep(model, processor, inputs, grid, measure_part_costs(model, inputs), progress=progress)
        report["tasks"][name] = task_report(*sweeps[name], tolerance, delta)
    chosen = fastest_for_every_task(sweeps, tolerance)
    chosen_points = []
    for name, (full, points) in sweeps.items():
        point = next((p for p in points if p.settings == chosen), None)
        chosen_points.append(point)
        report["tasks"][name]["chosen"] = None if point is None else chosen_report(point, full)
    if plot is not None:
        report["plot"] = str(plot(sweeps, chosen))
    report["chosen"] = None if chosen is None else with_encoder_min_exit_layer(chosen, chosen_points)
    if write_to is not None:
        report["written_to"] = str(save_calibration(model, report, write_to))
    return report


def task_report(
    full: OperatingPoint, points: Sequence[OperatingPoint], tolerance: float, delta: float
) -> dict[str, Any]:
    """A task's part of the calibration report: the full model's quality, the Pareto frontier and the setting
    Learn then Test certifies (risk level `tolerance`, error level `delta`)."""
    guaranteed = learn_then_test(points, risk_level=tolerance, delta=delta)
    return {
        "full_quality": full.quality,
        "pareto_frontier": [
            {
                "settings": p.settings,
                "quality": p.quality,
                "expected_time_reduction": p.expected_time_reduction,
                "seconds": p.seconds,
            }
            for p in pareto_frontier(points)
        ],
        "learn_then_test": None if guaranteed is None else guaranteed.settings,
    }


def chosen_report(point: OperatingPoint, full: OperatingPoint) -> dict[str, Any]:
    """The chosen setting's point on one task, against the full model's."""
    return {
        "quality": point.quality,
        "quality_ratio": point.quality / full.quality if full.quality else None,
        "expected_time_reduction": point.expected_time_reduction,
        "per_row_time_reduction": point.per_row_time_reduction,
        "seconds": point.seconds,
        "full_seconds": full.seconds,
    }


def save_calibration(model, report: dict[str, Any], model_dir: str | Path) -> Path:
    """Save `report["chosen"]` as the generation defaults of `model` in `model_dir` and the report beside it as
    calibration.json; returns the generation config's path. ValueError, nothing written, when nothing was chosen."""
    if report["chosen"] is None:
        raise ValueError(
            f"No setting keeps every task within {report['tolerance']:.1%} of the full model: nothing written."
        )
    write_generation_defaults(model, report["chosen"])
    model.generation_config.save_pretrained(model_dir)
    Path(model_dir, "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    return Path(model_dir, "generation_config.json")


__all__ = [
    "OperatingPoint",
    "Sweeps",
    "calibrate",
    "calibration_grid",
    "fastest_for_every_task",
    "fastest_within_tolerance",
    "hoeffding_p_value",
    "learn_then_test",
    "pareto_frontier",
    "save_calibration",
    "sweep",
    "with_encoder_min_exit_layer",
    "write_generation_defaults",
]
