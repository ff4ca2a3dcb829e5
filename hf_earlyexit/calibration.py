"""Choosing exit thresholds from a sweep: the Pareto frontier of quality vs expected time reduction, the fastest
setting within a quality tolerance of the full model, or the fastest setting Learn then Test certifies
(`risk_control`: with probability 1 - delta, its risk against the full model is at most the level asked for).

`sweep` evaluates each candidate setting of a grid on a calibration split and records an `OperatingPoint`; the
choosing functions only choose among points, so they are exact on any score table. `calibrate` is the whole run
behind `hf-earlyexit calibrate`: sweep every task, choose one setting for all, and save it as the model's defaults.
A certificate needs the order of its fixed-sequence test fixed before the tested samples are seen: `calibrate` with
a `risk` orders the grid on the first `ORDERING_SHARE` of each task's samples and tests on the rest.
"""

import contextlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .benchmark import measure_part_costs, timed_on
from .evaluation import Asks, TaskInputs, risk_losses, run_task, score, split_task_inputs, task_inputs
from .loading import weights_fingerprint
from .measures import PartCosts, expected_time_reduction
from .modeling.exit_controllers import SimilarityExit, make_controller
from .modeling.exit_knobs import DRAFTING_KNOBS, ENCODER_PARTS, EXIT_KNOBS, encoder_exit_parts
from .modeling.generation_early_exit import EarlyExitSettings
from .risk_control import LossKind, check_risk, fixed_sequence_test, samples_needed
from .sharding import from_main_process, is_main_process
from .tasks import get_task

# The default grid: the decoder's policies with their thresholds, and the encoder streams' similarity thresholds.
# The encoder's reach down to 0.9: on the embedded model a stream's layer-2 output is 0.88-0.94 similar to its
# input, so a grid starting at 0.95 never let a stream stop before layer 3.
DECODER_THRESHOLDS = {"similarity": (0.95, 0.98), "confidence": (0.6, 0.8, 0.9, 0.95)}
ENCODER_THRESHOLDS = (0.9, 0.93, 0.95, 0.98)
# With a risk to certify: the share of each task's calibration samples that orders the grid; the rest are tested.
# The order only needs each setting's expected time reduction, an average over many tokens and layers that a tenth
# of the samples already ranks; what can be certified grows with the tested samples.
ORDERING_SHARE = 0.1
DEFAULT_TOLERANCE = 0.01  # the quality a chosen setting may lose against the full model
DEFAULT_DELTA = 0.1  # a certificate's error level


@dataclass
class OperatingPoint:
    """One evaluated setting.

    settings: the `generate` knobs (e.g. {"exit_threshold": 0.9, "encoder_text_exit_threshold": 0.99}).
    quality: the task metric on the calibration split (higher is better).
    expected_time_reduction: 1 - (cost-weighted layers run) / (the full model's), below 1 (below 0 where the asks
        cost more than the layers save), batch-aware at the batch size the point was evaluated with (a step costs its
        deepest row).
    seconds: measured wall-clock of the split, when timed.
    sample_losses: per sample, a loss in [0, 1] against the full model (the task's `risk_loss`: 1 if the answer
        differs, or a caption's relative CIDEr drop); what Learn then Test controls.
    sample_scores: per sample, the quality (captions' CIDEr), when the task's loss needs it.
    predictions: the outputs, when the point came from a `sweep`.
    shallowest_encoder_exit: the fewest encoder layers any sample's image or text ran, when it came from a `sweep`.
    per_row_time_reduction: the same counting each row's own layers (the papers' figure), from a `sweep`.
    """

    settings: dict[str, Any]
    quality: float
    expected_time_reduction: float
    seconds: float | None = None
    sample_losses: list[float] | None = field(default=None, repr=False)
    sample_scores: list[float] | None = field(default=None, repr=False)
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


def check_tolerance(tolerance: float) -> None:
    """ValueError unless the quality a setting may lose, a share of the full model's, lies in [0, 1)."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"`tolerance` must lie in [0, 1), got {tolerance}.")


def within_tolerance(quality: float, full_quality: float, tolerance: float) -> bool:
    """quality >= (1 - tolerance) x full_quality, up to float rounding (38/53 is 0.95 x 40/53 exactly)."""
    return quality >= (1 - tolerance) * full_quality - 1e-12 * abs(full_quality)


def fastest_within_tolerance(
    points: Sequence[OperatingPoint], full_quality: float, tolerance: float = 0.01
) -> OperatingPoint | None:
    """The point with the largest expected time reduction whose quality is at least (1 - tolerance) x the full
    model's (ties: the higher quality); None if no point qualifies."""
    check_tolerance(tolerance)
    eligible = [
        p
        for p in points
        if saves_time(p.expected_time_reduction) and within_tolerance(p.quality, full_quality, tolerance)
    ]
    return max(eligible, key=lambda p: (p.expected_time_reduction, p.quality), default=None)


def saves_time(expected_time_reduction: float) -> bool:
    """Whether a setting with this expected time reduction is expected to be faster than the full model: one that is
    not (its exit tests cost more than the layers it skips) is never chosen, since the full model is then better in
    both quality and time."""
    return expected_time_reduction > 0


def settings_key(settings: dict[str, Any]) -> str:
    """One text per setting; a controller by its repr, a threshold per request as its list."""
    return json.dumps(settings, sort_keys=True, default=lambda value: getattr(value, "tolist", value.__repr__)())


def fixed_sequence(points: Sequence[OperatingPoint], ordering: Sequence[OperatingPoint]) -> list[OperatingPoint]:
    """`points` from the least to the most aggressive by the expected time reduction of the same settings in
    `ordering` (measured on other samples); ValueError when `ordering` lacks a setting or a point lacks losses."""
    reductions = {settings_key(point.settings): point.expected_time_reduction for point in ordering}
    for point in points:
        if settings_key(point.settings) not in reductions:
            raise ValueError(f"The ordering split has no point for the setting {point.settings}.")
        if not point.sample_losses:
            raise ValueError(f"Learn then Test needs per-sample losses; the point {point.settings} has none.")
    return sorted(points, key=lambda point: reductions[settings_key(point.settings)])


def learn_then_test(
    points: Sequence[OperatingPoint],
    ordering: Sequence[OperatingPoint],
    risk_level: float = 0.01,
    delta: float = 0.1,
    loss: LossKind = "binary",
) -> list[tuple[OperatingPoint, float]]:
    """Learn then Test: fixed-sequence testing of `points` (per-sample losses of kind `loss` on the tested samples)
    from the least to the most aggressive, by the expected time reductions of `ordering` (`fixed_sequence`). Returns the
    certified points with their p-values: with probability at least 1 - delta over the tested samples, every one of
    them has expected loss at most `risk_level` on new data from the same distribution. Empty when even the first
    setting fails."""
    ordered = fixed_sequence(points, ordering)
    p_values = fixed_sequence_test([point.sample_losses for point in ordered], risk_level, delta, loss)
    return list(zip(ordered, p_values, strict=False))  # the certified prefix


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
    streams = encoder_exit_parts(config)
    per_stream = [[None, *encoder_thresholds]] * len(streams)
    grid = []
    for knobs, thresholds in itertools.product(decoder, itertools.product(*per_stream)):
        encoder = {f"{part}_exit_threshold": t for part, t in zip(streams, thresholds, strict=True) if t is not None}
        if knobs or encoder:
            grid.append({**knobs, **encoder})
    return grid


def sweep(
    model,
    processor,
    inputs: TaskInputs,
    grid: Sequence[dict[str, Any]],
    costs: PartCosts,
    progress: bool = True,
    label: str = "calibrating",
) -> tuple[OperatingPoint, list[OperatingPoint]]:
    """The full model and every setting of `grid` on `inputs`: quality, expected time reduction (with `costs`),
    seconds, and per sample the task's `risk_loss` against the full model (what Learn then Test controls).
    `label`: the progress bar's first word."""
    from tqdm.auto import tqdm

    config, batch_size, task = model.config, inputs.batches[0]["input_ids"].shape[0], inputs.task
    per_sample = task.risk_loss == "bounded"

    def evaluate(knobs: dict[str, Any], full: OperatingPoint | None) -> OperatingPoint:
        run = run_task(model, processor, inputs, knobs)
        encoder_layers_run = run.encoder_exit_layers[run.encoder_exit_layers > 0]  # 0: a modality the input lacks
        layers = (run.encoder_exit_layers, run.decoder_exit_layers, costs, config.encoder_layers, config.decoder_layers)
        asks = Asks.of(model, knobs)
        scores = score(task, run.predictions, inputs.targets, per_sample=per_sample)
        sample_scores = scores.get(f"{task.quality_key}_per_sample")
        losses = (
            [0.0] * len(run.predictions)
            if full is None
            else risk_losses(task, run.predictions, sample_scores, full.predictions, full.sample_scores)
        )
        return OperatingPoint(
            settings=knobs,
            quality=scores[task.quality_key],
            expected_time_reduction=expected_time_reduction(
                *layers, batch_size, asks.layers, asks.policy, asks.encoder_layers
            ),
            seconds=run.seconds,
            sample_losses=losses,
            sample_scores=sample_scores,
            predictions=run.predictions,
            shallowest_encoder_exit=int(encoder_layers_run.min()) if encoder_layers_run.numel() else None,
            per_row_time_reduction=expected_time_reduction(*layers, 1, asks.layers, asks.policy, asks.encoder_layers),
        )

    full = evaluate({}, None)
    points = [evaluate(knobs, full) for knobs in tqdm(grid, desc=f"{label} {task.name}", disable=not progress)]
    return full, points


def fastest_for_every_task(
    sweeps: dict[str, tuple[OperatingPoint, Sequence[OperatingPoint]]], tolerance: float = 0.01
) -> dict[str, Any] | None:
    """One setting for several tasks: among the settings every task's sweep evaluated, those within `tolerance` of
    the full model on every task, the one with the largest mean expected time reduction (None if none is)."""
    check_tolerance(tolerance)
    return fastest_on_every_task(
        {
            name: [point for point in points if within_tolerance(point.quality, full.quality, tolerance)]
            for name, (full, points) in sweeps.items()
        }
    )


def fastest_on_every_task(eligible: dict[str, Sequence[OperatingPoint]]) -> dict[str, Any] | None:
    """Among the settings eligible on every task (per task, its eligible points), the one with the largest mean
    expected time reduction, if above 0 (`saves_time`); None if no setting is eligible on all and saves time."""
    by_setting: dict[str, list[OperatingPoint]] = {}
    for points in eligible.values():
        for point in points:
            by_setting.setdefault(settings_key(point.settings), []).append(point)
    mean_reductions = {
        key: sum(point.expected_time_reduction for point in points) / len(points)
        for key, points in by_setting.items()
        if len(points) == len(eligible)
    }
    saving = [key for key, reduction in mean_reductions.items() if saves_time(reduction)]
    best = max(saving, key=mean_reductions.__getitem__, default=None)
    return None if best is None else dict(by_setting[best][0].settings)


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


# The knobs of the lossy mode at their defaults; speculative mode's own (`exit_mode`, the drafts) are left as saved.
LOSSY_DEFAULTS = {
    name: value for name, value in EXIT_KNOBS.items() if name not in ("exit_controller", "exit_mode", *DRAFTING_KNOBS)
}


def write_generation_defaults(model, settings: dict[str, Any]) -> None:
    """Make `settings` the model's exit defaults: they go to its generation config, which `save_pretrained` keeps,
    so a plain `generate` (also as remote code, without this package) exits this way. Raises ValueError on a
    knob that is unknown, invalid for the model, or not a JSON scalar (a controller object cannot be saved), but
    `draft_vocabulary`'s list of token ids."""
    scalars = (str, int, float, bool, type(None))
    values = [value for name, value in settings.items() if name != "draft_vocabulary"]
    if "exit_controller" in settings or any(not isinstance(value, scalars) for value in values):
        raise ValueError(f"Only scalar knobs can be saved as generation defaults, got {settings}.")
    # Validated with the saved defaults they join (a threshold against the saved policy), as `generate` reads them.
    EarlyExitSettings.from_knobs(model.config, model.generation_config, **settings)
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
    tolerance: float = DEFAULT_TOLERANCE,
    delta: float = DEFAULT_DELTA,
    decoder_thresholds: dict[str, Sequence[float]] = DECODER_THRESHOLDS,
    encoder_thresholds: Sequence[float] = ENCODER_THRESHOLDS,
    batch_rules: Sequence[dict[str, Any]] = ({},),
    plot: Callable[[Sweeps, dict[str, Any] | None], Path] | None = None,
    write_to: str | Path | None = None,
    progress: bool = True,
    risk: float | dict[str, float] | None = None,
) -> dict[str, Any]:
    """Sweep the grid of `decoder_thresholds` x `batch_rules` x `encoder_thresholds` on each task's first `samples`
    rows of `split` in batches of `batch_size` and choose the fastest setting (by the batch-aware expected time
    reduction) within `tolerance` of the full model on every task (with the shallowest encoder exit seen as
    `encoder_min_exit_layer`). Returns the JSON report `hf-earlyexit calibrate` prints: per task the full quality,
    the Pareto frontier and the chosen setting's point.

    risk: certify instead. Each task's first `ORDERING_SHARE` of samples orders the grid, the rest are tested:
        the choice is the fastest setting Learn then Test certifies on every task at risk level `risk` (one for
        all, or per task: {"caption": 0.1, ...}) and error level `delta` (each task's `risk_loss`), and each task's
        report holds its certificate, or, when no setting is certified on every task, where its fixed sequence
        stopped and the samples that would have certified it.

    plot: draws the sweeps with the chosen setting and returns the file, e.g.
        `lambda sweeps, chosen: plots.tradeoff_plot(sweeps, path, chosen)` (a callable: `plots` imports this module).
    write_to: the model's folder, where the choice is saved as its generation defaults and the report as
        calibration.json; ValueError, and nothing written, when nothing was chosen.
    Under `accelerate launch` the processes share each sweep's batches (`sharding`); the main process alone times
    the part costs, draws and writes.
    """
    levels = risk_levels(risk, tasks, delta)
    check_tolerance(tolerance)
    grid = calibration_grid(model.config, decoder_thresholds, encoder_thresholds, batch_rules)
    if not grid:
        raise ValueError("Nothing to sweep: give decoder thresholds, or encoder thresholds for an encoder that exits.")
    # What each policy's tests cost, so that asking fewer layers (`max_exit_layer`) counts as time saved, and what
    # each encoder stream's tests cost, so that an encoder exit that saves little counts as a loss.
    askers = {policy: make_controller(policy, values[0]) for policy, values in decoder_thresholds.items() if values}
    streams = encoder_exit_parts(model.config)
    encoder_askers = {part: SimilarityExit(encoder_thresholds[0]) for part in streams} if encoder_thresholds else {}
    # The time reductions are batch-aware and priced on this device, so the choice is for this batch size and device.
    rule = {"tolerance": tolerance} if levels is None else {"risk_level": levels, "delta": delta}
    report: dict[str, Any] = {
        "split": split,
        "batch_size": batch_size,
        **timed_on(model),
        **rule,
        "points": len(grid),
        "tasks": {},
    }
    sweeps: Sweeps = {}
    orderings: dict[str, tuple[list[OperatingPoint], int]] = {}  # with a risk: per task, its ordering and samples
    progress = progress and is_main_process()
    for name in tasks:
        inputs = task_inputs(name, processor, split, samples, batch_size, model.device)
        ordering_inputs = None
        if levels is not None:  # the test's order is fixed on samples it never sees, the part costs included
            given = inputs.samples
            first = max(2, round(ORDERING_SHARE * given))
            ordering_inputs, inputs = split_task_inputs(inputs, first, processor, split, model.device)
            if inputs.samples < 2:
                raise ValueError(
                    f"{name}: {given} samples are too few to both order the grid (on {ORDERING_SHARE:.0%} of them, at "
                    "least two: a caption score needs two) and test it on two or more; give more samples."
                )
        timed = inputs if ordering_inputs is None else ordering_inputs
        costs = from_main_process(
            lambda timed=timed: measure_part_costs(
                model, processor, timed, askers=askers, encoder_askers=encoder_askers
            )
        )
        if ordering_inputs is not None:
            _, ordering = sweep(model, processor, ordering_inputs, grid, costs, progress, "ordering the grid on")
            orderings[name] = (ordering, ordering_inputs.samples)
        sweeps[name] = sweep(model, processor, inputs, grid, costs, progress=progress)
        report["tasks"][name] = task_report(*sweeps[name])
    if levels is None:
        chosen = fastest_for_every_task(sweeps, tolerance)
    else:
        chosen, certificates = certified_for_every_task(sweeps, orderings, levels, delta)
        for name, certificate in certificates.items():
            report["tasks"][name]["certificate"] = certificate
    chosen_points = []
    for name, (full, points) in sweeps.items():
        point = next((p for p in points if p.settings == chosen), None)
        chosen_points.append(point)
        report["tasks"][name]["chosen"] = None if point is None else chosen_report(point, full)
    if plot is not None and is_main_process():
        report["plot"] = str(plot(sweeps, chosen))
    report["chosen"] = None if chosen is None else with_encoder_min_exit_layer(chosen, chosen_points)
    if write_to is not None and is_main_process():
        report["written_to"] = str(save_calibration(model, report, write_to))
    return report


def certified_for_every_task(
    sweeps: Sweeps,
    orderings: dict[str, tuple[list[OperatingPoint], int]],
    levels: dict[str, float],
    delta: float,
) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The fastest setting Learn then Test certifies on every task at its level (None if none is), and each task's
    `certificate_report`."""
    certified = {}
    for name, (_, points) in sweeps.items():
        ordering, _ = orderings[name]
        certified[name] = learn_then_test(points, ordering, levels[name], delta, get_task(name).risk_loss)
    chosen = fastest_on_every_task({name: [point for point, _ in pairs] for name, pairs in certified.items()})
    certificates = {}
    for name, pairs in certified.items():
        ordering, ordering_samples = orderings[name]
        ordered = fixed_sequence(sweeps[name][1], ordering)
        certificates[name] = certificate_report(
            get_task(name).risk_loss, ordered, pairs, chosen, levels[name], delta, ordering_samples
        )
    return chosen, certificates


def risk_levels(
    risk: float | dict[str, float] | None, tasks: Sequence[str], delta: float = 0.1
) -> dict[str, float] | None:
    """Each task's risk level: `risk` for all, or `risk[task]`; ValueError on a task without one, or a level or
    `delta` outside (0, 1)."""
    if risk is None:
        return None
    levels = risk if isinstance(risk, dict) else dict.fromkeys(tasks, risk)
    unknown = sorted(set(levels) - set(tasks))
    if unknown:
        raise ValueError(f"Risk levels for {unknown}, which are not among the tasks {list(tasks)}.")
    missing = [name for name in tasks if name not in levels]
    if missing:
        raise ValueError(f"No risk level for {missing}: give one for every task, or one for all.")
    for level in levels.values():
        check_risk(level, delta)
    return {name: levels[name] for name in tasks}


def certificate_report(
    loss: LossKind,
    ordered: Sequence[OperatingPoint],
    certified: Sequence[tuple[OperatingPoint, float]],
    chosen: dict[str, Any] | None,
    risk: float,
    delta: float,
    ordering_samples: int,
) -> dict[str, Any]:
    """A task's Learn-then-Test result: the chosen setting's certificate (its p-value and empirical risk on the tested
    samples) when it is certified; otherwise where the fixed sequence over `ordered` stopped, with about how many
    tested samples would certify that setting at its empirical risk (None: none would)."""
    report = {
        "loss": loss,
        "risk_level": risk,
        "delta": delta,
        "ordering_samples": ordering_samples,
        "tested_samples": len(ordered[0].sample_losses),
        "certified_settings": len(certified),
    }
    for point, value in certified:
        if point.settings == chosen:
            return {**report, "settings": chosen, "p_value": value, "empirical_risk": mean(point.sample_losses)}
    if len(certified) < len(ordered):
        stopped = ordered[len(certified)]
        rate = mean(stopped.sample_losses)
        report["stopped_at"] = {
            "settings": stopped.settings,
            "empirical_risk": rate,
            "samples_needed": samples_needed(rate, risk, delta, loss),
        }
    return report


def task_report(full: OperatingPoint, points: Sequence[OperatingPoint]) -> dict[str, Any]:
    """A task's part of the calibration report: the full model's quality and the Pareto frontier."""
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


def not_chosen(report: dict[str, Any]) -> str:
    """Why a calibration report chose nothing, in one line (with a risk: the samples that would have certified)."""
    if "risk_level" not in report:
        return (
            f"No setting keeps every task within {report['tolerance']:.1%} of the full model and is expected to be "
            "faster than it"
        )
    needed = {
        name: task["certificate"].get("stopped_at", {}).get("samples_needed") for name, task in report["tasks"].items()
    }
    levels = ", ".join(f"{name} {level:.1%}" for name, level in report["risk_level"].items())
    return (
        f"No setting is certified on every task at its risk level ({levels}; delta {report['delta']}) and expected "
        f"to be faster than the full model; tested samples that would certify where each task's sequence stopped: "
        f"{needed}"
    )


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


# The picture of a calibration in its model folder, which `publish` puts on the card.
PLOT_FILE = "tradeoff.png"


def save_calibration(model, report: dict[str, Any], model_dir: str | Path, plot: str | Path | None = None) -> Path:
    """Save `report["chosen"]` as the generation defaults of `model` in `model_dir` and the report beside it as
    calibration.json; returns the generation config's path. ValueError, nothing written, when nothing was chosen.
    The folder's tradeoff.png, unless it is this calibration's `plot`, pictured the calibration replaced: removed,
    since `publish` puts it on the card."""
    if report["chosen"] is None:
        raise ValueError(f"{not_chosen(report)}: nothing written.")
    # The grid ran each setting on top of no exit: the lossy knobs it did not set are saved at their defaults, or
    # an earlier calibration's (an encoder threshold, a `max_exit_layer`) would stay and change what it measured.
    write_generation_defaults(model, {**LOSSY_DEFAULTS, **report["chosen"]})
    write_together(model_dir, {"calibration.json": report}, model.generation_config)
    earlier_plot = Path(model_dir, PLOT_FILE)
    if earlier_plot.is_file() and (plot is None or Path(plot).resolve() != earlier_plot.resolve()):
        earlier_plot.unlink()
    return Path(model_dir, "generation_config.json")


def write_together(folder: str | Path, records: dict[str, dict[str, Any]], generation_config) -> None:
    """`generation_config` (its `save_pretrained`) and the JSON `records` into `folder`, all or none: written into a
    scratch folder inside it first and moved into place once every one is, so that a write that fails (a full disk, a
    read-only file) leaves no defaults without the record of how they were chosen. Each record names the weights it
    was measured on (`weights_fingerprint`), which `publish` checks."""
    weights = weights_fingerprint(folder)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".calibration-") as scratch:
        generation_config.save_pretrained(scratch)
        for name, record in records.items():
            Path(scratch, name).write_text(json.dumps({**record, "weights": weights}, indent=2) + "\n")
        moved: list[tuple[Path, Path | None]] = []  # (file replaced, its earlier version kept in the scratch folder)
        with folder_locked(folder), restored_on_error(moved):
            for path in sorted(Path(scratch).iterdir()):
                target, kept = Path(folder, path.name), None
                if target.is_dir():
                    raise IsADirectoryError(f"{target} is a folder, where the calibration writes a file.")
                if target.exists():
                    kept = path.with_name(f"{path.name}.before")
                    target.replace(kept)
                moved.append((target, kept))
                path.replace(target)


@contextlib.contextmanager
def folder_locked(folder: str | Path):
    """An exclusive lock on `folder` (POSIX `flock`, where the file system has locks; none elsewhere): two
    calibrations writing into one model folder at once take turns, so that its defaults and records come from one."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (NFS without lockd, some FUSE): the write goes on unlocked
            pass
        yield
    finally:
        os.close(descriptor)  # releases the lock


@contextlib.contextmanager
def restored_on_error(moved: list[tuple[Path, Path | None]]):
    """Where a later file could not be replaced (OSError), the earlier ones of `moved` (file replaced, its earlier
    version or None) go back to what they were."""
    try:
        yield
    except OSError:
        for target, kept in reversed(moved):
            if kept is not None:
                kept.replace(target)
            else:
                target.unlink(missing_ok=True)
        raise


__all__ = [
    "OperatingPoint",
    "Sweeps",
    "calibrate",
    "calibration_grid",
    "fastest_for_every_task",
    "fastest_within_tolerance",
    "certified_for_every_task",
    "risk_levels",
    "fastest_on_every_task",
    "learn_then_test",
    "pareto_frontier",
    "save_calibration",
    "sweep",
    "with_encoder_min_exit_layer",
    "write_generation_defaults",
    "write_together",
]
