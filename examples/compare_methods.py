"""MuE, DEED, BLIPEE, CALM and a control, trained from one backbone and measured side by side (docs/methods.md).

    python examples/compare_methods.py --quick --output-dir docs/methods --runs-dir out/methods-runs  # 2 CPU cores
    python examples/compare_methods.py --output-dir out/methods  # the full budget, for a GPU

--quick is a reduced budget that finishes in under 30 minutes on 2 CPU cores (21-25 min measured).

1. The shared start: the embedded model's encoder, embeddings and tokenizer under a freshly initialised decoder,
   trained on the task mixture with the final-layer loss only, so that no method starts from exits that already work
   (the embedded model itself was trained with MuE's layer-wise loss).
2. Each method trains its exits from that start on the same mixture, with the same steps, per seed:
   MuE (layer-wise loss), DEED (deep supervision through adapters), BLIPEE (exit transformer layers on the frozen
   backbone, cross-entropy + adversarial), CALM (layer-wise loss weighted by depth), and the control (the final-layer
   loss alone, i.e. as many more steps of the shared start's training).
3. Each row of the main table (a method and its exit policy, `ROWS`) is calibrated on validation: the fastest setting
   of its grid, by the batch-aware expected time reduction, within `--tolerance` of its own full model on every task.
   That setting is then measured on test with `task_benchmark`: quality, expected time reduction (per row and
   batch-aware), BLIPEE's parameter speedup, wall clock at batch 1 and 16, and the speculative mode drafting with
   the same exit (tokens/s, acceptance).
4. The papers' ablations on the first seed (`ABLATIONS`).

Writes into --output-dir: results.json (every number), recipes.json (every run's options and budget), tables.md
(the tables of docs/methods.md) and tradeoff_<task>.png. The trained models go to --runs-dir, each with its
recipe.json, and a run already there is reused (an interrupted comparison resumes; delete a run to retrain it).
"""

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, EarlyExitTrainingArguments, OFAProcessor
from hf_earlyexit.benchmark import task_benchmark
from hf_earlyexit.calibration import calibration_grid, chosen_report, fastest_for_every_task, pareto_frontier, sweep
from hf_earlyexit.evaluation import TaskInputs, flop_costs, run_task, score, task_inputs
from hf_earlyexit.modeling.exit_knobs import SPECULATIVE_KNOBS, encoder_exit_parts
from hf_earlyexit.plots import new_figure, save
from hf_earlyexit.tasks import MIXTURE, TASKS, training_mixture
from hf_earlyexit.training import train_exits

EMBEDDED_MODEL = Path(__file__).resolve().parents[1] / "hf_earlyexit" / "embedded_model"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXIT_LAYERS = [1, 2, 3, 4, 5]  # BLIPEE's exit transformer layers: after every decoder layer but the last


@dataclass(frozen=True)
class Method:
    """How one method trains its exits from the shared start: `EarlyExitTrainingArguments` fields, the exit heads it
    adds to the config, whether its rows keep their labels, and whether its encoder runs image and text jointly."""

    training: dict[str, Any]
    heads: dict[str, Any] = field(default_factory=dict)
    labels: bool = True
    joint_encoder: bool = False


ADVERSARIAL = {"exit_loss": "adversarial", "freeze_backbone": True}
METHODS = {
    "control": Method({"exit_loss": "none"}),
    "mue": Method({"exit_loss": "layerwise"}),
    "deed": Method({"exit_loss": "deep_supervision"}, {"exit_adapter_dim": 64}),
    "blipee": Method(ADVERSARIAL, {"exit_transformer_layers": EXIT_LAYERS}),
    "calm": Method({"exit_loss": "layerwise", "exit_loss_weights": "increasing"}),
}
# Trained for the ablations only (first seed).
ABLATION_METHODS = {
    "mue_joint": Method({"exit_loss": "layerwise"}, joint_encoder=True),
    "blipee_kl_adversarial": Method(ADVERSARIAL, {"exit_transformer_layers": EXIT_LAYERS}, labels=False),
    "blipee_kd_only": Method(
        {"exit_loss": "distill", "freeze_backbone": True}, {"exit_transformer_layers": EXIT_LAYERS}
    ),
    "blipee_ce_only": Method({**ADVERSARIAL, "adversarial_weight": 0.0}, {"exit_transformer_layers": EXIT_LAYERS}),
}


@dataclass(frozen=True)
class Row:
    """A row of a table: the model of `method`, and the grid its calibration sweeps (the decoder's `policy` at its
    thresholds, each with `knobs`; per encoder stream, no exit or a similarity threshold when `encoder_exits`)."""

    method: str
    policy: str
    knobs: dict[str, Any] = field(default_factory=dict)
    encoder_exits: bool = False

    def grid(self, config, thresholds: dict[str, tuple[float, ...]], encoder: tuple[float, ...]) -> list[dict]:
        points = calibration_grid(config, {self.policy: thresholds[self.policy]}, encoder if self.encoder_exits else ())
        return [{**point, **self.knobs} if "exit_policy" in point else point for point in points]


ROWS = {
    "control / similarity": Row("control", "similarity"),
    "control / confidence": Row("control", "confidence"),
    "MuE (paper decay)": Row(
        "mue", "similarity", {"exit_threshold_schedule": "mue_decay", "kv_strategy": "copy"}, True
    ),
    "MuE (official decay)": Row(
        "mue", "similarity", {"exit_threshold_schedule": "mue_official", "kv_strategy": "copy"}, True
    ),
    "DEED": Row("deed", "confidence", {"kv_strategy": "recompute"}),
    "BLIPEE": Row("blipee", "confidence"),
    "CALM / confidence": Row("calm", "confidence", {"kv_strategy": "propagate"}),
    "CALM / margin": Row("calm", "margin", {"kv_strategy": "propagate"}),
}
ABLATIONS = {
    "MuE Table 4": {
        "MuE (decomposed, layer-wise)": ROWS["MuE (paper decay)"],
        "without decomposition": Row("mue_joint", "similarity", ROWS["MuE (paper decay)"].knobs, True),
        "without the layer-wise loss": Row("control", "similarity", ROWS["MuE (paper decay)"].knobs, True),
    },
    "BLIPEE components": {
        "CE + adversarial": ROWS["BLIPEE"],
        "KL + adversarial (no labels)": Row("blipee_kl_adversarial", "confidence"),
        "KD only": Row("blipee_kd_only", "confidence"),
        "CE only": Row("blipee_ce_only", "confidence"),
    },
    "DEED": {
        "adapters, recompute": ROWS["DEED"],
        "no adapters (layer-wise model), recompute": Row("mue", "confidence", {"kv_strategy": "recompute"}),
        "adapters, propagate": Row("deed", "confidence", {"kv_strategy": "propagate"}),
        "adapters, copy": Row("deed", "confidence", {"kv_strategy": "copy"}),
    },
}
# The budgets: --quick fits a 2-core CPU in under 30 minutes; the full one is meant for a GPU.
BUDGETS = {
    "quick": dict(backbone_steps=300, method_steps=80, samples=60, test_samples=64, timing_samples=12, repeats=1),
    "full": dict(backbone_steps=4000, method_steps=1500, samples=300, test_samples=500, timing_samples=100, repeats=2),
}
THRESHOLDS = {
    "quick": {"similarity": (0.9, 0.95, 0.98), "confidence": (0.4, 0.6, 0.8), "margin": (0.2, 0.4, 0.6)},
    "full": {
        "similarity": (0.9, 0.95, 0.98, 0.99),
        "confidence": (0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
        "margin": (0.2, 0.4, 0.6, 0.8, 0.9),
    },
}
BUDGET_HELP = {
    "backbone_steps": "training steps of the shared start",
    "method_steps": "training steps of each method's run",
    "samples": "validation samples per task that calibrate",
    "test_samples": "test samples per task at batch 16",
    "timing_samples": "test samples per task at batch 1",
    "repeats": "timed rounds of each test",
}
# The quality loss a calibration allows: 60 validation samples cannot resolve 1% (one answer is 1.7%).
TOLERANCES = {"quick": 0.02, "full": 0.01}
ENCODER_THRESHOLDS = {"quick": (0.9,), "full": (0.9, 0.93, 0.95, 0.98)}
TIMING_BATCH_SIZES = (1, 16)


def training_arguments(options, output_dir: Path, steps: int, seed: int, **fields) -> EarlyExitTrainingArguments:
    """The arguments every run shares (the embedded model's recipe), with `fields` on top."""
    return EarlyExitTrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        weight_decay=0.0,
        warmup_steps=max(1, steps // 10),
        lr_scheduler_type="cosine",
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=DEVICE == "cpu",
        seed=seed,
        encoder_exit_sampling=0.5,
        disable_tqdm=True,
        **fields,
    )


def train_run(options, name: str, start: Path | None, steps: int, seed: int, method: Method) -> Path:
    """Train one run (the shared start when `start` is None) and save it with its recipe; a saved run is reused."""
    output = options.runs_dir / (name if start is None else f"{name}-seed{seed}")
    if (output / "recipe.json").exists():
        return output
    if start is None:  # the embedded model's encoder under a fresh decoder
        model = EarlyExitOFAForConditionalGeneration.from_pretrained(options.embedded_model)
        processor = OFAProcessor.from_pretrained(options.embedded_model)
        torch.manual_seed(seed)
        fresh = EarlyExitOFAForConditionalGeneration(model.config)
        model.decoder.layers.load_state_dict(fresh.decoder.layers.state_dict())
        model.decoder.layer_norm.load_state_dict(fresh.decoder.layer_norm.state_dict())
    else:
        config = {**method.heads, **({"decompose_encoder_modalities": False} if method.joint_encoder else {})}
        model = EarlyExitOFAForConditionalGeneration.from_pretrained(start, **config)
        processor = OFAProcessor.from_pretrained(start)
    args = training_arguments(options, output, steps, seed, **method.training)
    started = time.perf_counter()
    trainer = train_exits(
        model, processor, mixture(seed), args, text_column="prompt", target_column="target", labels=method.labels
    )
    trainer.save_model()
    (output / "training_args.bin").unlink(missing_ok=True)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    recipe = {
        "run": name,
        "started_from": str(start) if start else f"{options.embedded_model} with a fresh decoder",
        "seed": seed,
        "steps": steps,
        "method": {
            "training": method.training,
            "heads": method.heads,
            "labels": method.labels,
            "joint_encoder": method.joint_encoder,
        },
        "batch_size": options.batch_size,
        "learning_rate": options.learning_rate,
        "mixture": MIXTURE,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "seconds": round(time.perf_counter() - started, 1),
        "last_log": history[-1] if history else None,
    }
    (output / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return output


@functools.cache
def mixture(seed: int) -> datasets.Dataset:
    """The training mixture every run draws from, built once per seed."""
    return training_mixture(MIXTURE, seed)[0]


def load(model_dir: Path):
    model = EarlyExitOFAForConditionalGeneration.from_pretrained(model_dir).eval()
    return model.to(DEVICE), OFAProcessor.from_pretrained(model_dir)


@functools.cache
def split_inputs(processor_dir: Path, task: str, split: str, samples: int, batch_size: int) -> TaskInputs:
    """A split's model inputs, built once: every run keeps the shared start's processor."""
    return task_inputs(task, OFAProcessor.from_pretrained(processor_dir), split, samples, batch_size, DEVICE)


def calibrated_row(options, row: Row, model, processor) -> dict[str, Any]:
    """Sweep `row`'s grid on each task's validation rows; the frontier per task and the setting chosen for all. The
    expected time reductions that choose weigh the parts by their FLOPs: the same on every machine and run, where
    measured costs would let timing noise pick between close settings (the test report has the measured ones)."""
    grid = row.grid(model.config, THRESHOLDS[options.budget], ENCODER_THRESHOLDS[options.budget])
    sweeps = {}
    for task in options.tasks:
        inputs = split_inputs(options.embedded_model, task, "validation", options.samples, options.batch_sizes[-1])
        sweeps[task] = sweep(model, processor, inputs, grid, flop_costs(model, inputs), progress=False)
    chosen = fastest_for_every_task(sweeps, options.tolerance)
    frontier = {
        task: [{"settings": point.settings, **chosen_report(point, full)} for point in pareto_frontier(points)]
        for task, (full, points) in sweeps.items()
    }
    return {"grid_points": len(grid), "chosen": chosen, "validation_frontier": frontier}


def speculative_knobs(chosen: dict[str, Any]) -> dict[str, Any] | None:
    """The speculative mode drafting with the chosen decoder exit (None without one): its output is the full model's."""
    if "exit_threshold" not in chosen:
        return None
    return {
        **{name: value for name, value in chosen.items() if name not in SPECULATIVE_KNOBS},
        "exit_mode": "speculative",
    }


def tested_row(options, chosen: dict[str, Any], model, processor, timed: bool) -> dict[str, dict]:
    """`chosen` on each task's test rows at each batch size (batch 1 only when `timed`): `task_benchmark`'s report."""
    reports = {}
    for task in options.tasks:
        for batch_size in options.batch_sizes if timed else options.batch_sizes[-1:]:
            samples = options.timing_samples if batch_size == 1 else options.test_samples
            inputs = split_inputs(options.embedded_model, task, "test", samples, batch_size)
            speculative = speculative_knobs(chosen) if batch_size == 1 else None
            reports[f"{task}@{batch_size}"] = task_benchmark(
                model, processor, inputs, chosen, options.repeats, speculative=speculative, round_shares=False
            )
    return reports


def measured_row(options, row: Row, model_dir: Path, timed: bool) -> dict[str, Any]:
    started = time.perf_counter()
    model, processor = load(model_dir)
    result = {
        "method": row.method,
        "policy": row.policy,
        "model": str(model_dir),
        **calibrated_row(options, row, model, processor),
    }
    calibrated = time.perf_counter()
    if result["chosen"] is not None:
        result["test"] = tested_row(options, result["chosen"], model, processor, timed)
    result["seconds"] = {
        "calibration": round(calibrated - started, 1),
        "test": round(time.perf_counter() - calibrated, 1),
    }
    swept = f"{row.policy} {row.knobs}" if row.knobs else row.policy  # two MuE rows differ by their schedule alone
    print(f"{model_dir.name} / {swept}: chosen {result['chosen']}, {result['seconds']} s", file=sys.stderr)
    return result


def measured_seeds(options, row: Row, runs: dict[tuple[str, int], Path]) -> list[dict[str, Any]]:
    """`row` on each seed's run; timed at batch 1 on the first `options.timed_seeds` seeds whose calibration chose a
    setting (a seed without one has nothing to time)."""
    results = []
    for seed in options.seeds:
        timed = sum(result["chosen"] is not None for result in results) < options.timed_seeds
        results.append(measured_row(options, row, runs[row.method, seed], timed))
    return results


def encoder_streams(options, model_dir: Path) -> dict[str, dict[str, float]]:
    """MuE's Table 2 at our scale: per task, encoder stream and similarity threshold (the other stream at full depth;
    a joint encoder has one exit), the quality kept and the mean layers each stream ran, on validation."""
    model, processor = load(model_dir)
    streams = encoder_exit_parts(model.config)
    table = {}
    for task in options.tasks:
        inputs = split_inputs(options.embedded_model, task, "validation", options.samples, options.batch_sizes[-1])
        quality = {}
        for stream, threshold in [(None, None), *((s, t) for s in streams for t in ENCODER_THRESHOLDS[options.budget])]:
            run = run_task(model, processor, inputs, {f"{stream}_exit_threshold": threshold} if stream else {})
            quality[stream, threshold] = score(inputs.task, run.predictions, inputs.targets)[inputs.task.quality_key]
            if stream is not None:
                image, text = run.encoder_exit_layers.double().mean(0).tolist()
                table[f"{task} / {stream} / {threshold}"] = {
                    "quality_ratio": round(quality[stream, threshold] / quality[None, None], 4)
                    if quality[None, None]
                    else None,
                    "image_layers": round(image, 2),
                    "text_layers": round(text, 2),
                }
    return table


def row_summary(result: dict[str, Any], task: str, batch_size: int) -> dict[str, float] | None:
    """The headline numbers of one row on one task at one batch size (None when nothing was chosen or timed)."""
    report = result.get("test", {}).get(f"{task}@{batch_size}")
    if report is None:
        return None
    early, speculative = report["early_exit"], report.get("speculative", {})
    return {
        "quality_ratio": report["quality_ratio"],
        "expected_time_reduction": early["expected_time_reduction"],
        "per_row_time_reduction": early["expected_time_reduction_per_row"],
        "parameter_speedup": early["parameter_speedup"],
        "wall_clock_speedup": report["full"]["seconds"] / early["seconds"],
        "speculative_speedup": speculative.get("speedup_over_full"),
        "acceptance": speculative.get("acceptance_rate"),
        "speculative_lossless": speculative.get("same_outputs_as_full"),
    }


# The main table's columns: a row summary's key -> (header, scale, unit).
COLUMNS = {
    "quality_ratio": ("quality, % of full", 100, "%"),
    "expected_time_reduction": ("ETR, batch-aware", 100, "%"),
    "per_row_time_reduction": ("ETR, per row", 100, "%"),
    "parameter_speedup": ("parameter speedup", 1, "×"),
    "wall_clock_speedup": ("wall clock", 1, "×"),
    "speculative_speedup": ("speculative", 1, "×"),
    "acceptance": ("drafts accepted", 100, "%"),
}


def spread(values: list[float | None], scale: float = 1, unit: str = "") -> str:
    """Mean ± standard deviation over seeds (of those with a number), scaled; "–" when none has one."""
    values = [scale * value + 0.0 for value in values if value is not None]  # + 0.0: no "-0%"
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3g}{unit}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}{unit}"


def main_table(results: dict[str, list[dict]], tasks: list[str], batch_size: int) -> str:
    """Markdown: a row per method and policy; per task, the mean ± sd over the seeds of each headline number, and how
    many seeds' calibrations found a setting within tolerance."""
    lines = []
    for task in tasks:
        headers = [header for header, _, _ in COLUMNS.values()]
        lines += [f"**{task}, batch {batch_size}**", "", "| row | seeds chosen | " + " | ".join(headers) + " |"]
        lines.append("|---" * (len(COLUMNS) + 2) + "|")
        for name, seeds in results.items():
            summaries = [row_summary(result, task, batch_size) for result in seeds]
            cells = [spread([s[key] if s else None for s in summaries], *form[1:]) for key, form in COLUMNS.items()]
            chosen = sum(result["chosen"] is not None for result in seeds)
            lines.append(f"| {name} | {chosen}/{len(seeds)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def encoder_stream_table(streams: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "## Ablation: MuE Table 2 (encoder streams, validation)",
        "",
        "| encoder | task / stream / threshold | quality, % of full | image layers | text layers |",
        "|---|---|---|---|---|",
    ]
    for encoder, table in streams.items():
        for name, numbers in table.items():
            quality = spread([numbers["quality_ratio"]], 100, "%")
            lines.append(f"| {encoder} | {name} | {quality} | {numbers['image_layers']} | {numbers['text_layers']} |")
    return "\n".join([*lines, ""])


def xy(items: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """Percentages of two numbers of each item that has both."""
    kept = [item for item in items if item and item[x] is not None and item[y] is not None]
    return [100 * item[x] for item in kept], [100 * item[y] for item in kept]


def tradeoff_plots(results: dict[str, list[dict]], tasks: list[str], output_dir: Path) -> list[Path]:
    """One PNG per task, every row on the same axes: quality against the expected time reduction (the first seed's
    validation frontier as a line, each seed's calibrated setting on test as a dot), and against the wall clock."""
    paths = []
    for task in tasks:
        figure = new_figure(figsize=(11, 4.5))
        by_layers, by_clock = figure.subplots(1, 2, sharey=True)
        for index, (name, seeds) in enumerate(results.items()):
            colour = f"C{index % 10}"
            by_layers.plot(*xy(seeds[0]["validation_frontier"][task], "expected_time_reduction", "quality_ratio"), "-",
                           color=colour, alpha=0.5, label=name)  # fmt: skip
            for batch_size, marker in zip(TIMING_BATCH_SIZES, "so", strict=True):
                tested = [row_summary(result, task, batch_size) for result in seeds]
                if batch_size == TIMING_BATCH_SIZES[-1]:
                    by_layers.plot(*xy(tested, "expected_time_reduction", "quality_ratio"), marker, color=colour)
                clock = [{**s, "saved": 1 - 1 / s["wall_clock_speedup"]} for s in tested if s]
                by_clock.plot(*xy(clock, "saved", "quality_ratio"), marker, color=colour)
        by_layers.set_xlabel("expected time reduction, batch-aware, batch 16 (%)")
        by_layers.set_ylabel("quality (% of its own full model)")
        by_layers.set_title(f"{task}: validation frontiers, test dots")
        by_layers.legend(fontsize=7)
        by_clock.set_xlabel("wall-clock time saved on test (%): squares batch 1, dots batch 16")
        by_clock.axvline(0, color="grey", linewidth=0.5)
        paths.append(save(figure, output_dir / f"tradeoff_{task}.png"))
    return paths


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("out/methods"), help="where the results go")
    parser.add_argument("--runs-dir", type=Path, help="where the trained models go (default: OUTPUT_DIR/runs)")
    parser.add_argument("--quick", action="store_true", help="the reduced budget for a CPU (< 30 min on 2 cores)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the main table's runs")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated (default: all three)")
    parser.add_argument("--tolerance", type=float, help="quality loss each calibration allows (quick 0.02, full 0.01)")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--embedded-model", type=Path, default=EMBEDDED_MODEL, help="where the shared start comes from")
    parser.add_argument("--no-ablations", dest="ablations", action="store_false", help="the main table only")
    parser.add_argument("--timed-seeds", type=int, help="per row, seeds timed at batch 1 (default: quick 1, else all)")
    budget = parser.add_argument_group("budget (default: the --quick or the full budget)")
    for name, text in BUDGET_HELP.items():
        quick, full = BUDGETS["quick"][name], BUDGETS["full"][name]
        budget.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"{text} (quick {quick}, full {full})")
    options = parser.parse_args(argv)
    options.budget = "quick" if options.quick else "full"
    options.runs_dir = options.runs_dir or options.output_dir / "runs"
    options.tolerance = TOLERANCES[options.budget] if options.tolerance is None else options.tolerance
    for name, value in BUDGETS[options.budget].items():
        if getattr(options, name) is None:
            setattr(options, name, value)
    options.seeds = [int(seed) for seed in options.seeds.split(",")]
    options.tasks = options.tasks.split(",")
    unknown = sorted(set(options.tasks) - set(TASKS))
    if unknown or not options.seeds:
        parser.error(f"unknown task(s) {unknown}; the tasks are {sorted(TASKS)}" if unknown else "give a seed")
    if options.timed_seeds is None:
        options.timed_seeds = 1 if options.quick else len(options.seeds)
    options.batch_sizes = TIMING_BATCH_SIZES
    return options


def main(argv: list[str] | None = None) -> dict[str, Any]:
    options = parse_options(argv)
    transformers.logging.set_verbosity_error()  # new exit heads are reported missing at every load, by design
    started = time.perf_counter()
    backbone = train_run(options, "backbone", None, options.backbone_steps, 0, Method({"exit_loss": "none"}))
    runs = {
        (name, seed): train_run(options, name, backbone, options.method_steps, seed, method)
        for seed in options.seeds
        for name, method in METHODS.items()
    }
    results = {name: measured_seeds(options, row, runs) for name, row in ROWS.items()}
    ablations, streams = {}, {}
    if options.ablations:
        seed = options.seeds[0]
        for name, method in ABLATION_METHODS.items():
            runs[name, seed] = train_run(options, name, backbone, options.method_steps, seed, method)
        main_rows = {id(row): name for name, row in ROWS.items()}
        ablations = {
            table: {
                name: (
                    results[main_rows[id(row)]][0]
                    if id(row) in main_rows
                    else measured_row(options, row, runs[row.method, seed], timed=False)
                )
                for name, row in rows.items()
            }
            for table, rows in ABLATIONS.items()
        }
        streams = {
            "decomposed (MuE)": encoder_streams(options, runs["mue", seed]),
            "joint": encoder_streams(options, runs["mue_joint", seed]),
        }
    options.output_dir.mkdir(parents=True, exist_ok=True)
    recipes = [json.loads((path / "recipe.json").read_text()) for path in [backbone, *runs.values()]]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()}
    report = {
        "options": settings,
        "seconds": round(time.perf_counter() - started, 1),
        "results": results,
        "ablations": ablations,
        "encoder_streams": streams,
    }
    (options.output_dir / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (options.output_dir / "recipes.json").write_text(
        json.dumps({"options": settings, "runs": recipes}, indent=2) + "\n"
    )
    tables = [f"# Measured {time.strftime('%Y-%m-%d')} ({options.budget} budget, {recipes[0]['device']})", ""]
    tables += [main_table(results, options.tasks, batch) for batch in options.batch_sizes[::-1]]
    tables += [
        f"## Ablation: {table}\n\n"
        + main_table({k: [v] for k, v in rows.items()}, options.tasks, options.batch_sizes[-1])
        for table, rows in ablations.items()
    ]
    if streams:
        tables.append(encoder_stream_table(streams))
    (options.output_dir / "tables.md").write_text("\n".join(tables))
    tradeoff_plots(results, options.tasks, options.output_dir)
    print(json.dumps({"seconds": report["seconds"], "output_dir": str(options.output_dir)}))
    return report


if __name__ == "__main__":
    main()
