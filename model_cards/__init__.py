"""The model card of a published early-exit OFA model: the template `ofa_early_exit.md` (`string.Template`, `$name`
fields) and what fills it, the measured trade-off first.

`hf_earlyexit.publishing` writes it into the Hub folder it assembles; `EarlyExitTrainer.create_model_card` writes it
after training. A leaf: it imports nothing of ours but the exit knobs.
"""

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from ..modeling.exit_knobs import DRAFTING_KNOBS, EXIT_KNOBS, shown_knobs

CARD_TEMPLATE = "ofa_early_exit.md"
TAGS = ["early-exit", "ofa", "vision-language", "hf-earlyexit", "custom_code"]
# What every `hf-earlyexit bench --json` record holds.
BENCHMARK_KEYS = {"task", "metric", "full", "early_exit", "wall_clock_time_reduction"}
NOT_MEASURED = (
    "Not measured yet. Run `hf-earlyexit bench MODEL_DIR --task TASK --json >> MODEL_DIR/benchmark.jsonl` for each "
    "task, then `hf-earlyexit publish MODEL_DIR --repo-id ...`, which puts the numbers here (and refuses a card "
    "without them)."
)


def read_benchmark(path: str | Path) -> list[dict[str, Any]]:
    """The records of a file of `hf-earlyexit bench MODEL_DIR --json` output (one JSON object per line)."""
    if not Path(path).is_file():
        raise ValueError(f"No benchmark file at {path}.")
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {number}: not JSON ({error.msg}).") from None
        missing = BENCHMARK_KEYS - set(record) if isinstance(record, dict) else BENCHMARK_KEYS
        if missing:
            raise ValueError(f"{path}, line {number}: not a `hf-earlyexit bench --json` record (no {sorted(missing)}).")
        records.append(record)
    return records


# The knobs that shape the lossy exits a record measured (speculative mode's own never reach them).
LOSSY = [name for name in EXIT_KNOBS if name not in DRAFTING_KNOBS]


def record_settings(records: list[dict[str, Any]], defaults: dict[str, Any] | None = None) -> list[str]:
    """Per record, its skipped layers' K/V strategy and the knobs where its lossy exits' settings differ from another
    record's or from the model's saved generation `defaults` (the drafts' knobs do not reach them); a record measured
    with other settings than those defaults says so, since the card calls them the model's."""
    settings = [{**EXIT_KNOBS, **record["early_exit"].get("settings", {})} for record in records]
    shown = [name for name in EXIT_KNOBS if name not in ("kv_strategy", *DRAFTING_KNOBS)]
    saved = None if defaults is None else {name: defaults.get(name, EXIT_KNOBS[name]) for name in LOSSY}
    compared = settings if saved is None else [*settings, saved]
    differing = [name for name in shown if len({repr(s[name]) for s in compared}) > 1]
    described = []
    for s in settings:
        text = "; ".join([s["kv_strategy"], *(f"{name}={s[name]}" for name in differing)])
        stale = saved is not None and any(repr(s[name]) != repr(saved[name]) for name in LOSSY)
        described.append(f"{text} (not the saved defaults)" if stale else text)
    return described


def measured_table(records: list[dict[str, Any]], defaults: dict[str, Any] | None = None) -> str:
    """A Markdown table of benchmark records: quality of both models, expected and wall-clock time reduction, and
    the settings of each (`record_settings`, against the model's generation `defaults` when given)."""
    if not records:
        raise ValueError("No benchmark records: the card needs measured numbers (`hf-earlyexit bench --json`).")
    rows = [
        "| task | metric | full | early exit | % of full | expected time reduction (measured / FLOPs) "
        "| wall-clock reduction | samples x batch | device | skipped layers' K/V; settings that differ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for record, setting in zip(records, record_settings(records, defaults), strict=True):
        full, early = record["full"], record["early_exit"]
        measured = full["quality"] is not None and early["quality"] is not None  # None: the metric had too few samples
        # No ratio to a full model that scored 0 (a model that cannot do the task yet): "—", not "nan%".
        ratio = f"{early['quality'] / full['quality']:.1%}" if measured and full["quality"] else "—"
        qualities = [f"{quality:.3f}" if measured else "—" for quality in (full["quality"], early["quality"])]
        flops = early.get("expected_time_reduction_flops")
        rows.append(
            f"| {record['task']} | {record['metric']} | {qualities[0]} | {qualities[1]} "
            f"| {ratio} | {early['expected_time_reduction']:.1%} / {'—' if flops is None else f'{flops:.1%}'} "
            f"| {record['wall_clock_time_reduction']:.1%} | {record.get('samples', '?')} x "
            f"{record.get('batch_size', '?')} | {record.get('device', '?')} "
            f"| {setting} |"
        )
    return "\n".join(rows)


def training_summary(recipe: dict[str, Any] | None) -> str:
    """The card's training section: the recipe's options, then what else it recorded."""
    if recipe is None:
        return "Not recorded with this folder (no `training_recipe.json`)."
    lines = [f"- `{name}`: {value}" for name, value in recipe.get("options", {}).items()]
    for name in ("script", "parameters", "device", "mixture", "train_runtime_seconds"):
        if name in recipe:
            lines.append(f"- {name.replace('_', ' ')}: {recipe[name]}")
    return "The recipe (`training_recipe.json` in this repository):\n\n" + "\n".join(lines)


def render_model_card(
    repo_id: str,
    config: dict[str, Any],
    generation_config: dict[str, Any],
    table: str,
    recipe: dict[str, Any] | None = None,
    plot: str | None = None,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    license: str | None = None,
    pipeline_tag: str = "image-text-to-text",
    tags: Sequence[str] = (),
    calibration: dict[str, Any] | None = None,
) -> str:
    """The README.md of a published model: Hub metadata (`tags` after the library's own), then the template in
    `model_cards/` filled with the usage code, the guarantee of the defaults (`calibration`: calibration.json, whose
    per-task certificates `calibrate --risk` wrote), the measured `table` (`measured_table`), the `plot` (a file name
    in the repository), the training recipe and the limitations."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=[*TAGS, *(tag for tag in tags if tag not in TAGS)],
        datasets=datasets or None,
        base_model=base_model,
        license=license,
    )
    knobs = shown_knobs(
        {name: generation_config[name] for name in EXIT_KNOBS if generation_config.get(name) is not None}
    )
    body = Template(resources.files(__name__).joinpath(CARD_TEMPLATE).read_text())
    architecture = (
        f"{config.get('encoder_layers')} encoder and {config.get('decoder_layers')} decoder layers, "
        f"d_model {config.get('d_model')}"
    )
    text = body.substitute(
        title=repo_id.split("/")[-1],
        architecture=architecture,
        **encoder_words(bool(config.get("decompose_encoder_modalities"))),
        repo_id=repo_id,
        settings=f"`{json.dumps(knobs)}`" if knobs else "none (the model runs at full depth unless asked to exit)",
        defaults=defaults_sentence(bool(knobs), calibration),
        guarantee=guarantee(calibration),
        table=table,
        plot=f"\n![Quality against expected time reduction]({plot})\n" if plot else "",
        training=training_summary(recipe),
    )
    return f"---\n{data.to_yaml()}\n---\n\n{text}"


def encoder_words(decomposed: bool) -> dict[str, str]:
    """What the card says of the encoder's exits: per modality stream (MuE's decomposed encoder), or of the joint
    encoder, whose image and text stop together."""
    if decomposed:
        return {
            "encoder_exits": "The encoder runs image and text as separate streams, each of which can stop once its "
            "layers stop changing its states",
            "encoder_exit_layers": "the encoder layer the image and the text stream exited after",
        }
    return {
        "encoder_exits": "The encoder (image and text together) can stop once its layers stop changing the states",
        "encoder_exit_layers": "the encoder layer each row exited after, twice (image and text run together)",
    }


def defaults_sentence(saved: bool, calibration: dict[str, Any] | None) -> str:
    """Where the saved exit defaults come from: a calibration if `calibration.json` records its choice."""
    if not saved:
        return "This repository saves no exit defaults: `generate` runs the full model unless given exit knobs."
    if calibration is None or calibration.get("chosen") is None:
        return "The exit settings below are this repository's generation defaults (no calibration is recorded)."
    return "The exit settings below were calibrated on held-out data and are this repository's generation defaults."


def guarantee(calibration: dict[str, Any] | None) -> str:
    """What the saved defaults guarantee: each task's Learn-then-Test certificate, or the tolerance they were chosen
    within (no guarantee beyond the calibration split)."""
    if calibration is None or calibration.get("chosen") is None:
        return "Guarantee: none recorded (no `calibration.json`)."
    if "risk_level" not in calibration:
        return (
            f"Guarantee: none beyond the calibration split, where every task stayed within "
            f"{calibration['tolerance']:.1%} of the full model's quality."
        )
    tasks, delta = len(calibration["tasks"]), calibration["delta"]
    together = (
        f" (all {tasks} together: at least {max(0.0, 1 - tasks * delta):.0%}, by the union bound)" if tasks > 1 else ""
    )
    lines = [
        f"Certified by Learn then Test: for each task, with probability at least {1 - delta:.0%} over its "
        f"calibration samples, the expected loss against the full model is at most the level below{together}.",
        "",
        "| task | loss | level | tested samples | empirical | p-value |",
        "|---|---|---|---|---|---|",
    ]
    for name, task in calibration["tasks"].items():
        certificate = task["certificate"]
        loss = "answer differs" if certificate["loss"] == "binary" else "relative CIDEr drop"
        lines.append(
            f"| {name} | {loss} | {certificate['risk_level']:.1%} | {certificate['tested_samples']} | "
            f"{certificate['empirical_risk']:.2%} | {certificate['p_value']:.2g} |"
        )
    return "\n".join(lines)


__all__ = [
    "BENCHMARK_KEYS",
    "CARD_TEMPLATE",
    "NOT_MEASURED",
    "TAGS",
    "defaults_sentence",
    "guarantee",
    "measured_table",
    "read_benchmark",
    "render_model_card",
    "training_summary",
]
