"""`hf-earlyexit` command line: convert, caption, train, eval, calibrate, bench, demo, publish.

It only parses options, calls the library (`loading`, `evaluation`, `calibration`, `benchmark`, `demo`, `training`,
`publishing`) and prints what it returns. Every user error (bad path, unreadable image, wrong model folder, bad
option) ends in one line on stderr and exit status 2, never a traceback.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import datasets

from .data import CAPTION_PROMPT
from .loading import check_writable, load_image, load_model_and_processor, weights_fingerprint
from .modeling.exit_knobs import (
    EXIT_KNOBS,
    EXIT_MODES,
    EXIT_TOKEN_LAYERS,
    KV_STRATEGIES,
    POLICY_NAMES,
    ROW_EXIT_PLANS,
    check_knobs,
    non_default_knobs,
)
from .publishing import PublishError, publish
from .training import DEFAULT_MAX_STEPS

if TYPE_CHECKING:
    import torch


def print_report(report: dict[str, Any], one_line: bool) -> None:
    print(json.dumps(report, indent=None if one_line else 2))


def given_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The exit knobs given on the command line (`add_knob_arguments`); one given as 'none' is None whatever the
    saved default (a threshold: that part runs in full; `--max-exit-layer`: any layer; `--draft-max-batch-size`:
    drafts at any batch size)."""
    given = {name: getattr(args, name) for name in EXIT_KNOBS if getattr(args, name, None) is not None}
    return {name: None if value == OFF else value for name, value in given.items()}


OFF = "none"  # a knob's value on the command line for None: no exit, no bound


def positive_int(text: str) -> int:
    """An argparse type for counts (beams, tokens, steps): a whole number of at least 1."""
    value = int(text) if text.strip().lstrip("+").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for rates: a finite number above 0 (inf trained to NaN weights, 0 trained nothing)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def task_list(text: str) -> list[str]:
    """`--tasks`: comma-separated task names, checked before anything loads."""
    from .tasks import TASKS

    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ValueError(f"Unknown task {unknown[0]!r} in --tasks; tasks are {list(TASKS)}.")
    return names


def threshold_or_off(text: str) -> float | str:
    """A threshold knob's command-line value: a number, or 'none' (`OFF`)."""
    return number_or_off(text, float, "a number")


def int_or_off(text: str) -> int | str:
    """A count knob's command-line value: an integer, or 'none' (`OFF`)."""
    return number_or_off(text, int, "an integer")


def number_or_off(text: str, kind: type, what: str) -> int | float | str:
    if text.strip().lower() == OFF:
        return OFF
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} or '{OFF}', got {text!r}") from None


def check_samples(args: argparse.Namespace) -> None:
    # Before the model loads, and in the option's own name.
    if args.samples < 1:
        raise ValueError(f"--samples must be positive, got {args.samples}.")
    if getattr(args, "batch_size", 1) < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}.")


def check_meteor(args: argparse.Namespace) -> None:
    if args.meteor and args.task != "caption":
        raise ValueError(f"--meteor scores captions; --task {args.task} has none: drop --meteor.")


def with_default_samples(args: argparse.Namespace, samples: int, batch_size: int) -> None:
    """`--samples` and `--batch-size` where not given (a 0 is given, and refused), checked."""
    args.samples = samples if args.samples is None else args.samples
    args.batch_size = batch_size if args.batch_size is None else args.batch_size
    check_samples(args)


def cmd_convert(args: argparse.Namespace) -> None:
    from .convert import convert_checkpoint

    model = convert_checkpoint(args.source, args.target, True, args.tokenizer, args.image_size)
    print(f"converted {args.source} -> {args.target} ({model.num_parameters() / 1e6:.1f}M parameters)")
    if args.tokenizer:
        print(f"saved the processor ({model.config.vocab_size} tokens, {args.image_size}px images)")
    else:  # `caption`, `eval`, `bench` and `publish` load one beside the weights
        print(
            "saved no processor: the other commands need one; convert again with --tokenizer DIR (OFA's BART "
            "vocab.json and merges.txt), or save one beside the weights (processor.save_pretrained)"
        )


def cmd_caption(args: argparse.Namespace) -> None:
    from .evaluation import caption_images

    if args.batch_size < 1:  # before the model loads
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}.")
    images = [load_image(path) for path in args.images]
    model, processor = load_model_and_processor(args.model_dir)
    knobs = {"exit_mode": args.exit_mode} if args.exit_mode else {}
    num_beams = args.num_beams or (1 if args.exit_mode == "speculative" else 5)  # speculative mode decodes greedily
    decoding = dict(num_beams=num_beams, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    captions, seconds = caption_images(model, processor, images, args.prompt, **decoding, progress=True, **knobs)
    for path, caption in zip(args.images, captions, strict=True):
        print(f"{path}\t{caption.strip()}")
    print(f"{len(images)} image(s) in {seconds:.2f} s", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import demo_lines, run_demo

    printed = 0
    for report in run_demo(args.model_dir, args.output_dir, args.batch_size):  # each task's line as it finishes
        lines = demo_lines(report)
        for line in lines[printed:]:
            print(line, flush=True)
        printed = len(lines)


def cmd_eval(args: argparse.Namespace) -> None:
    from .evaluation import evaluate_task, run_knobs
    from .sharding import is_main_process

    check_samples(args)
    check_meteor(args)
    given = given_knobs(args)
    if args.full and given:
        raise ValueError(f"--full runs the full model: drop the exit knobs {sorted(given)}.")
    model, processor = load_for_this_process(args.model_dir)
    knobs = run_knobs(model, args.full, **given)
    report = evaluate_task(
        model, processor, args.task, args.split, args.samples, args.batch_size, knobs, args.meteor, progress=True,
        against_full=args.against_full,
    )  # fmt: skip
    if is_main_process():
        print_report(report, args.json)


def load_for_this_process(model_dir: str) -> tuple[Any, Any]:
    """`eval` and `calibrate` under `accelerate launch`: one model per process, on the device Accelerate gives it
    (in one process: the GPU if there is one, where speculative calibration times its drafts)."""
    from .sharding import process_device

    model, processor = load_model_and_processor(model_dir)
    return model.to(process_device()), processor


def cmd_calibrate(args: argparse.Namespace) -> None:
    if args.write:  # checked before the sweep, whose result a folder it cannot write into would lose
        check_writable(Path(args.model_dir), "--write into")
    if args.exit_mode == "speculative":
        calibrate_drafts(args)
        return
    from .calibration import (
        DECODER_THRESHOLDS,
        DEFAULT_DELTA,
        DEFAULT_TOLERANCE,
        ENCODER_THRESHOLDS,
        calibrate,
        check_tolerance,
        not_chosen,
        risk_levels,
        save_calibration,
    )
    from .plots import check_plot_path, tradeoff_plot
    from .sharding import is_main_process

    unused = flags_set(args, DRAFT_CALIBRATION)
    if unused:
        raise ValueError(f"{unused} time speculative drafts: they have no meaning without --exit-mode speculative.")
    if args.risk and flags_set(args, ("tolerance",)):
        raise ValueError("--risk certifies in place of --tolerance's quality bound: give one of them.")
    if not args.risk and flags_set(args, ("delta",)):
        raise ValueError("--delta is the error level of --risk's certificate: give --risk, or drop --delta.")
    args.tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    args.delta = DEFAULT_DELTA if args.delta is None else args.delta
    risk = parse_risk(args.risk) if args.risk else None
    risk_levels(risk, task_list(args.tasks), args.delta)  # checked before the model loads
    check_tolerance(args.tolerance)
    if args.plot:
        check_plot_path(args.plot)  # not after the sweep, whose report a bad path would lose

    with_default_samples(args, 300, 64)
    given = args.encoder_thresholds
    encoder_thresholds = ENCODER_THRESHOLDS if given is None else parse_floats(given) if given else ()  # '': none
    decoder_thresholds = policy_thresholds(args, DECODER_THRESHOLDS)
    batch_rules = [
        non_default_knobs({"exit_token_layer": layer, "batch_stop_fraction": fraction, "max_exit_layer": last})
        for layer in parse_list(args.exit_token_layers, str, "--exit-token-layers must be comma-separated names")
        for fraction in parse_floats(args.batch_stop_fractions)
        for last in parse_list(args.max_exit_layers, layer_or_any, "--max-exit-layers must be layers or 'any'")
    ]
    model, processor = load_for_this_process(args.model_dir)
    for rule in batch_rules:  # before the sweep, not at its first setting
        check_knobs(rule, model.config)
    sweep = (task_list(args.tasks), args.split, args.samples, args.batch_size, args.tolerance, args.delta)
    tolerance = None if risk is not None else args.tolerance  # a certified choice has no quality line to stay above
    report = calibrate(
        model, processor, *sweep, decoder_thresholds, encoder_thresholds, batch_rules,
        plot=(lambda sweeps, chosen: tradeoff_plot(sweeps, args.plot, chosen, tolerance)) if args.plot else None,
        progress=not args.quiet,
        risk=risk,
    )  # fmt: skip
    if not is_main_process():
        return
    try:
        if args.write and report["chosen"] is not None:
            report["written_to"] = str(save_calibration(model, report, args.model_dir, args.plot))
    finally:  # also when nothing was chosen or writing failed: the sweep's frontiers stay the user's
        print_report(report, args.json)
    if report["chosen"] is None:
        if args.write:
            raise ValueError(f"{not_chosen(report)}: nothing written.")
        print(f"{not_chosen(report)}.", file=sys.stderr)


def calibrate_drafts(args: argparse.Namespace) -> None:
    """`calibrate --exit-mode speculative`: the drafts and draft length with the most tokens per second."""
    from .draft_calibration import (
        DRAFT_THRESHOLDS,
        calibrate_drafts,
        check_batch_sizes,
        drafting_grid,
        no_drafts_chosen,
        save_drafting_calibration,
    )

    one_process("calibrate --exit-mode speculative")
    task_list(args.tasks)  # checked before the model loads

    unused = flags_set(args, (*LOSSY_CALIBRATION, "encoder_thresholds", "plot"))
    if unused:
        raise ValueError(f"{unused} have no meaning with --exit-mode speculative, whose output is the full model's.")
    with_default_samples(args, 64, 1)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be positive, got {args.repeats}.")
    thresholds = policy_thresholds(args, DRAFT_THRESHOLDS)
    draft_tokens = parse_list(args.draft_tokens, int, "--draft-tokens must be comma-separated integers")
    schedules = parse_list(args.draft_schedules, str, "--draft-schedules must be comma-separated names")
    drafting_grid(thresholds, draft_tokens, schedules)  # checked before the model loads
    batch_sizes = (
        parse_list(args.draft_batch_sizes, int, "--draft-batch-sizes must be comma-separated integers")
        if args.draft_batch_sizes
        else []
    )
    check_batch_sizes(args.batch_size, batch_sizes)
    model, processor = load_for_this_process(args.model_dir)  # timed where generate will run: the GPU if any
    report = calibrate_drafts(
        model, processor, task_list(args.tasks), args.split, args.samples, args.batch_size, thresholds, draft_tokens,
        args.repeats, progress=not args.quiet, batch_sizes=batch_sizes, vocabulary_size=args.draft_vocabulary_size,
        schedules=schedules,
    )  # fmt: skip
    try:
        if args.write and report["chosen"] is not None:
            report["written_to"] = save_drafting_calibration(model, report, args.model_dir)
    finally:  # also when nothing was chosen or writing failed: the timings stay the user's (--write saves the ids)
        vocabulary = report.get("draft_vocabulary")
        shown = {name: value for name, value in (vocabulary or {}).items() if name != "token_ids"}
        print_report({**report, "draft_vocabulary": shown} if vocabulary else report, args.json)
    if report["chosen"] is None:
        if args.write:
            raise ValueError(f"{no_drafts_chosen(report)}: nothing written.")
        print(f"{no_drafts_chosen(report)}.", file=sys.stderr)


# The options of each kind of calibration (their `dest`), refused with the other kind rather than ignored.
LOSSY_CALIBRATION = ("risk", "delta", "tolerance", "exit_token_layers", "batch_stop_fractions", "max_exit_layers")
DRAFT_CALIBRATION = (
    "draft_tokens", "draft_schedules", "draft_layers", "repeats", "draft_batch_sizes", "draft_vocabulary_size",
)  # fmt: skip


def flags_set(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The options among `names` that the command line set to other than their defaults, as flags."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != args.parser.get_default(name)]


def policy_thresholds(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, list[float]]:
    """The decoder policies' thresholds to sweep: `--similarity-thresholds` / `--confidence-thresholds` (and the
    drafts' fixed layers, `--draft-layers`), else the mode's `defaults`; an empty option leaves its policy out."""
    given = {
        "similarity": args.similarity_thresholds,
        "confidence": args.confidence_thresholds,
        "fixed_layer": args.draft_layers,
    }
    chosen = {
        policy: text if text is not None else ",".join(map(str, defaults.get(policy, ())))
        for policy, text in given.items()
    }
    return {
        policy: parse_list(text, int, "--draft-layers must be comma-separated layers")
        if policy == "fixed_layer"
        else parse_floats(text)
        for policy, text in chosen.items()
        if text
    }


def cmd_bench(args: argparse.Namespace) -> None:
    from .benchmark import checked_device

    one_process("bench")

    device = checked_device(args.device)  # checked before any model is loaded
    report = bench_model(args, device) if args.model_dir else bench_random_weights(args, device)
    print_report(report, args.json)


# The options of each kind of benchmark (their `dest`), refused with another kind rather than ignored (the exit
# knobs, with a model folder only, are checked apart).
MODEL_BENCH = ("task", "meteor", "compiled_full", "samples", "batch_size", "full")
RANDOM_WEIGHTS_BENCH = ("preset", "batch_sizes", "new_tokens", "image_size")
FORCED_EXIT_BENCH = ("encoder_batch_size",)
TRAINING_STEP_BENCH = ("exit_losses",)


def one_process(command: str) -> None:
    """Timings run in one process per device: processes sharing a machine would time each other."""
    from .sharding import process_state

    if process_state().num_processes > 1:
        raise ValueError(f"{command} times one process per device: run it without `accelerate launch`.")


def bench_model(args: argparse.Namespace, device: "torch.device") -> dict[str, Any]:
    """`bench MODEL_DIR`: the full vs the early-exit model on a task."""
    from .benchmark import model_benchmark
    from .evaluation import run_knobs

    if args.forced_exit is not None or args.training_step:
        raise ValueError("Give a model folder (task benchmark) or --forced-exit / --training-step, not both.")
    unused = flags_set(args, (*RANDOM_WEIGHTS_BENCH, *FORCED_EXIT_BENCH, *TRAINING_STEP_BENCH))
    if unused:
        raise ValueError(
            f"{unused} set up --forced-exit / --training-step: a model folder's benchmark has no use for them."
        )
    check_samples(args)
    check_meteor(args)
    if args.full:
        raise ValueError("bench times the full model beside the exits anyway: drop --full.")
    model, processor = load_model_and_processor(args.model_dir)
    knobs = run_knobs(model, **given_knobs(args))
    run = dict(samples=args.samples, batch_size=args.batch_size, repeats=args.repeats, device=device, dtype=args.dtype)
    report = model_benchmark(
        model, processor, args.task, knobs, meteor=args.meteor, compiled_full=args.compiled_full, **run
    )
    return {**report, "weights": weights_fingerprint(args.model_dir)}  # what `publish` checks the record against


def bench_random_weights(args: argparse.Namespace, device: "torch.device") -> dict[str, Any]:
    """`bench --forced-exit K` or `bench --training-step`: a preset's size with random weights."""
    from .benchmark import forced_exit_benchmark, training_step_benchmark

    if args.forced_exit is None and not args.training_step:
        raise ValueError("Give a model folder, --forced-exit K or --training-step.")
    if args.forced_exit is not None and args.training_step:
        raise ValueError("--forced-exit and --training-step are two benchmarks: give one.")
    other = TRAINING_STEP_BENCH if args.forced_exit is not None else FORCED_EXIT_BENCH
    unused = [*flags_set(args, (*MODEL_BENCH, *other)), *(f"--{name.replace('_', '-')}" for name in given_knobs(args))]
    if unused:
        kind = "--forced-exit" if args.forced_exit is not None else "--training-step"
        raise ValueError(f"{unused} have no meaning with {kind}, which times random weights at its own settings.")
    message = "--batch-sizes must be comma-separated integers"
    batch_sizes = tuple(parse_list(args.batch_sizes, int, message)) if args.batch_sizes else ()
    if any(size < 1 for size in batch_sizes) or args.repeats < 1 or args.new_tokens < 1:
        raise ValueError("--batch-sizes, --repeats and --new-tokens must be positive.")
    if args.training_step:
        ignored = [flag for flag, set_here in (("--device", device.type != "cpu"), ("--dtype", args.dtype != "float32"))
                   if set_here]  # fmt: skip
        if ignored:
            raise ValueError(f"--training-step times on the CPU in float32: drop {ignored}.")
        if len(batch_sizes) > 1:
            raise ValueError(f"--training-step times one batch size, got {list(batch_sizes)}.")
        return training_step_benchmark(
            args.preset,
            exit_losses=tuple(loss.strip() for loss in args.exit_losses.split(",")),
            batch_size=batch_sizes[0] if batch_sizes else 8,
            image_size=args.image_size,
            target_length=args.new_tokens,
            repeats=args.repeats,
            progress=True,
        )
    return forced_exit_benchmark(
        args.forced_exit,
        preset=args.preset,
        batch_sizes=batch_sizes or (1, 8),
        encoder_batch_size=args.encoder_batch_size,
        new_tokens=args.new_tokens,
        image_size=args.image_size,
        repeats=args.repeats,
        device=device,
        dtype=args.dtype,
        progress=True,
    )


def parse_risk(text: str) -> float | dict[str, float]:
    """'0.02' (every task) or 'vqa=0.02,caption=0.1' (per task)."""
    message = "--risk takes one level (0.02) or one per task (vqa=0.02,caption=0.1)"
    if "=" not in text:
        levels = parse_list(text, float, message)
        if len(levels) != 1:
            raise ValueError(f"{message}, got {text!r}.")
        return levels[0]
    pairs = [item.partition("=") for item in text.split(",")]
    names = [name.strip() for name, _, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--risk gives {repeated} more than one level.")
    return {name.strip(): parse_list(value, float, message)[0] for name, _, value in pairs}


def layer_or_any(text: str) -> int | None:
    """A `max_exit_layer` of a sweep: a layer, or 'any' (None: no bound)."""
    return None if text.strip() == "any" else int(text)


def parse_floats(text: str) -> list[float]:
    """'0.9,0.95' -> [0.9, 0.95] (thresholds)."""
    return parse_list(text, float, "Thresholds must be comma-separated numbers")


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """Exit knobs of `generate`; each one not given comes from the model's saved (calibrated) defaults."""
    parser.add_argument("--exit-threshold", dest="exit_threshold", type=threshold_or_off)
    parser.add_argument("--exit-policy", dest="exit_policy", choices=POLICY_NAMES)
    parser.add_argument("--encoder-image-exit-threshold", dest="encoder_image_exit_threshold", type=threshold_or_off)
    parser.add_argument("--encoder-text-exit-threshold", dest="encoder_text_exit_threshold", type=threshold_or_off)
    parser.add_argument("--encoder-exit-threshold", dest="encoder_exit_threshold", type=threshold_or_off)
    parser.add_argument("--kv-strategy", dest="kv_strategy", choices=KV_STRATEGIES)
    parser.add_argument("--row-exit", dest="row_exit", choices=ROW_EXIT_PLANS, help="ready rows: kept or compacted")
    parser.add_argument(
        "--exit-token-layer", dest="exit_token_layer", choices=EXIT_TOKEN_LAYERS, help="a ready row's token layer"
    )
    parser.add_argument("--batch-stop-fraction", dest="batch_stop_fraction", type=float)
    parser.add_argument(
        "--max-exit-layer",
        dest="max_exit_layer",
        type=int_or_off,
        help="the last decoder layer a token may exit after ('none': any, whatever the saved default)",
    )
    parser.add_argument(
        "--exit-mode",
        dest="exit_mode",
        choices=EXIT_MODES,
        help="exit (lossy) or speculative (the full model's output)",
    )
    parser.add_argument("--draft-exit-policy", dest="draft_exit_policy", choices=POLICY_NAMES, help="speculative")
    parser.add_argument(
        "--draft-exit-threshold",
        dest="draft_exit_threshold",
        type=threshold_or_off,
        help="speculative drafts ('none': the exit threshold)",
    )
    parser.add_argument(
        "--draft-max-batch-size",
        dest="draft_max_batch_size",
        type=int_or_off,
        help="speculative: the most rows a call drafts for; more decode in full ('none': any)",
    )
    parser.add_argument("--full", action="store_true", help="the full model (no exit)")


def add_task_arguments(parser: argparse.ArgumentParser, samples: int, batch_size: int) -> None:
    parser.add_argument("--samples", type=int, default=samples, help=f"samples of the split (default {samples})")
    parser.add_argument("--batch-size", type=int, default=batch_size)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The data, model and run options of `hf-earlyexit train` and `examples/train_*.py`."""
    parser.add_argument("--model-dir", help="a saved hf-earlyexit model to start from (default: a small new one)")
    parser.add_argument(
        "--dataset",
        default="easy-vqa",
        help="'easy-vqa', a save_to_disk folder, 'loader:folder' (imagefolder, json, parquet, ...; image paths "
        "relative to the folder) or a data set name",
    )
    parser.add_argument("--split", help="the split to train on (default train; none for a folder of one data set)")
    parser.add_argument("--image-column", default="image")
    parser.add_argument("--text-column", default="question", help="prompt column ('' = use --prompt for all rows)")
    parser.add_argument("--target-column", default="answer")
    parser.add_argument("--prompt", help=f"every row's prompt, with --text-column '' (default {CAPTION_PROMPT!r})")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        help=f"training steps in all (default {DEFAULT_MAX_STEPS}; with --resume, the stopped run's)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per process (default 32)")
    parser.add_argument("--learning-rate", type=positive_float, default=1e-4)
    parser.add_argument(
        "--save-steps", type=positive_int, default=500, help="checkpoint every N steps, the last kept (default 500)"
    )
    parser.add_argument("--resume", action="store_true", help="continue a stopped run from its last checkpoint")


def parse_layers(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (decoder layers for exit transformer layers)."""
    return parse_list(text, int, "Exit layers must be comma-separated layer numbers")


def parse_list(text: str, kind: type, message: str) -> list:
    """Comma-separated values of `kind`; ValueError with `message` on one that does not convert or is blank."""
    try:
        values = [kind(value) for value in text.split(",")]
    except ValueError:
        raise ValueError(f"{message}, got {text!r}.") from None
    if any(isinstance(value, str) and not value.strip() for value in values):
        raise ValueError(f"{message}, got {text!r} (a blank item).")
    return values


def cmd_train(args: argparse.Namespace) -> None:
    from .training import fine_tune

    config_fields = {}
    if args.exit_adapter_dim is not None:
        config_fields["exit_adapter_dim"] = args.exit_adapter_dim
    if args.exit_transformer_layers:
        config_fields["exit_transformer_layers"] = parse_layers(args.exit_transformer_layers)
    trainer = fine_tune(
        args, config_fields, exit_loss=args.exit_loss, exit_loss_weights=args.exit_loss_weights,
        freeze_backbone=args.freeze_backbone, disable_tqdm=False,
    )  # fmt: skip
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]  # none where a resumed run logged none
    losses = {key: round(value, 4) for key, value in (logged[-1] if logged else {}).items() if key.startswith("loss")}
    print(f"trained to step {trainer.state.global_step} with exit_loss={args.exit_loss!r}; last logged {losses}")
    print(f"saved the model and processor to {args.output_dir}")


class OneLineErrors(argparse.ArgumentParser):
    """argparse with a bad option reported as every other error is: one line, status 2 (not usage, then the error)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("hf-earlyexit").strip()  # a subcommand's parser names it
        self.exit(2, f"hf-earlyexit: error: {f'{command}: ' if command else ''}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="hf-earlyexit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert an official OFA checkpoint (HF port or fairseq)")
    convert.add_argument("--from", dest="source", required=True, help="official checkpoint folder or fairseq .pt")
    convert.add_argument("--to", dest="target", required=True, help="output folder (hf-earlyexit format)")
    convert.add_argument("--tokenizer", help="folder with BART vocab.json + merges.txt, saved as the processor")
    convert.add_argument("--image-size", type=positive_int, default=384, help="processor image size (default 384)")
    convert.set_defaults(run=cmd_convert)

    caption = commands.add_parser("caption", help="caption images with a saved model")
    caption.add_argument("model_dir")
    caption.add_argument("images", nargs="+")
    caption.add_argument("--prompt", default=CAPTION_PROMPT, help="the text beside each image ('' = the image alone)")
    caption.add_argument("--num-beams", type=positive_int, help="default 5; 1 with --exit-mode speculative")
    caption.add_argument("--exit-mode", dest="exit_mode", choices=EXIT_MODES, help="exit (lossy) or speculative")
    caption.add_argument("--max-new-tokens", type=positive_int, default=16)
    caption.add_argument("--batch-size", type=int, default=8, help="images per generate call (default 8)")
    caption.set_defaults(run=cmd_caption)

    train = commands.add_parser("train", help="train exits on an image-text data set (EarlyExitTrainer)")
    add_training_arguments(train)
    train.add_argument(
        "--exit-loss", default="layerwise", help="layerwise (default), deep_supervision, distill, adversarial or none"
    )
    train.add_argument(
        "--exit-loss-weights",
        default="uniform",
        help="uniform (default), increasing (CALM's: layer / depth) or one comma-separated weight per loss term",
    )
    train.add_argument("--exit-adapter-dim", type=positive_int, help="add DEED adaptation modules of this width")
    train.add_argument("--exit-transformer-layers", help="add BLIPEE exit layers after these decoder layers: 1,2,3")
    train.add_argument(
        "--freeze-backbone", action="store_true", help="train the exit heads only (needed by distill and adversarial)"
    )
    train.set_defaults(run=cmd_train)

    task_names = ["vqa", "entailment", "caption"]
    evaluate = commands.add_parser("eval", help="score a saved model on a task's split (JSON)")
    evaluate.add_argument("model_dir")
    evaluate.add_argument("--task", required=True, choices=task_names)
    evaluate.add_argument("--split", default="test", choices=["train", "validation", "test", "calibration"])
    evaluate.add_argument("--meteor", action="store_true", help="also METEOR for captions (Java, about 10 s)")
    evaluate.add_argument(
        "--against-full",
        action="store_true",
        help="also run the full model: the risk against it (the loss a `calibrate --risk` certificate bounds)",
    )
    evaluate.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    add_task_arguments(evaluate, samples=1000, batch_size=32)
    add_knob_arguments(evaluate)
    evaluate.set_defaults(run=cmd_eval)

    calibrate = commands.add_parser(
        "calibrate", help="sweep exit thresholds on a validation split and pick the fastest setting within tolerance"
    )
    calibrate.add_argument("model_dir")
    calibrate.add_argument("--tasks", default="vqa,entailment,caption", help="comma-separated (default: all three)")
    calibrate.add_argument("--split", default="validation", choices=["train", "validation", "test", "calibration"])
    calibrate.add_argument("--tolerance", type=float, help="quality loss allowed (default 0.01 = 1%%)")
    calibrate.add_argument(
        "--risk",
        help="certify instead (Learn then Test): the fastest setting whose risk against the full model is at most "
        "this with probability 1 - delta (answers: share that differ; captions: relative CIDEr drop); one level, "
        "or per task: vqa=0.02,caption=0.1",
    )
    calibrate.add_argument("--delta", type=float, help="with --risk: the error level (default 0.1)")
    calibrate.add_argument(
        "--encoder-thresholds", help="encoder streams' similarity thresholds, comma-separated ('' = none)"
    )
    calibrate.add_argument(
        "--similarity-thresholds", help="decoder, similarity policy ('' = none; default 0.95,0.98, drafts none)"
    )
    calibrate.add_argument(
        "--confidence-thresholds", help="decoder, confidence ('' = none; default 0.6,0.8,0.9,0.95, drafts 0.2,0.4,0.6)"
    )
    calibrate.add_argument(
        "--exit-mode",
        choices=EXIT_MODES,
        default="exit",
        help="exit: lossy thresholds by quality and time; speculative: the drafts with the most tokens/s (both timed "
        "on the GPU if there is one)",
    )
    calibrate.add_argument("--draft-tokens", default="4,8", help="speculative: draft lengths to time (default 4,8)")
    calibrate.add_argument(
        "--draft-schedules",
        default="constant,heuristic",
        help="speculative: draft length schedules (num_assistant_tokens_schedule) to time (default constant,heuristic)",
    )
    calibrate.add_argument(
        "--draft-layers", help="speculative: fixed layers to draft at (policy fixed_layer; '' = none; default 1,2)"
    )
    calibrate.add_argument("--repeats", type=int, default=2, help="speculative: timed rounds per batch (default 2)")
    calibrate.add_argument(
        "--draft-batch-sizes",
        default="",
        help="speculative: larger batch sizes to time the best settings at too (e.g. 8,16); sets draft_max_batch_size",
    )
    calibrate.add_argument(
        "--draft-vocabulary-size",
        type=positive_int,
        help="speculative: drafts propose only the N tokens most frequent in the split's references (draft_vocabulary)",
    )
    calibrate.add_argument(
        "--exit-token-layers", default="own", help="decoder batch rule to sweep: own, batch or own,batch"
    )
    calibrate.add_argument("--batch-stop-fractions", default="1.0", help="decoder batch rule to sweep: 1.0,0.75")
    calibrate.add_argument(
        "--max-exit-layers", default="any", help="the last decoder layer asked, to sweep: any,1,2 (default any)"
    )
    calibrate.add_argument("--plot", help="write the quality / time-reduction trade-off to this image (e.g. a PNG)")
    calibrate.add_argument("--write", action="store_true", help="save the choice as the model's generation defaults")
    calibrate.add_argument("--quiet", action="store_true", help="no progress bar")
    calibrate.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    calibrate.add_argument("--samples", type=int, help="samples of each split (default 300; speculative 64)")
    calibrate.add_argument("--batch-size", type=int, help="default 64; speculative 1 (the choice is for this size)")
    calibrate.set_defaults(run=cmd_calibrate, parser=calibrate)

    bench = commands.add_parser(
        "bench",
        help="MODEL_DIR: full vs early-exit model on a task's test split (quality, time reduction, wall clock); "
        "or --forced-exit / --training-step with random weights; prints JSON",
    )
    bench.add_argument("model_dir", nargs="?", help="a saved model: the task benchmark")
    bench.add_argument("--task", default="caption", choices=task_names, help="with MODEL_DIR (default caption)")
    bench.add_argument("--meteor", action="store_true", help="with MODEL_DIR: also METEOR for captions")
    bench.add_argument(
        "--compiled-full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with MODEL_DIR: also time the full model compiled (static cache, torch.compile), and each speedup over "
        "it; compiling takes tens of seconds per batch shape (default on)",
    )
    add_task_arguments(bench, samples=100, batch_size=1)
    add_knob_arguments(bench)
    bench.add_argument("--forced-exit", type=int, help="exit every row after this many layers")
    bench.add_argument(
        "--training-step",
        action="store_true",
        help="time a training step (forward + backward) per exit loss; --batch-sizes' first size is the batch, "
        "--new-tokens the target length",
    )
    bench.add_argument("--exit-losses", default="none,layerwise", help="with --training-step (default none,layerwise)")
    bench.add_argument("--preset", default="base", choices=["tiny", "medium", "base", "large", "huge"])
    bench.add_argument(
        "--batch-sizes", help="decoder batch sizes, comma-separated (default 1,8; --training-step: one, default 8)"
    )
    bench.add_argument("--encoder-batch-size", type=positive_int, default=1)
    bench.add_argument("--new-tokens", type=int, default=16)
    bench.add_argument("--image-size", type=positive_int, default=384)
    bench.add_argument("--repeats", type=int, default=2, help="timed rounds after a warm-up (default 2)")
    bench.add_argument("--device", default="cpu", help="where to time (cpu, cuda, ...); with MODEL_DIR too")
    bench.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],  # `benchmark.DTYPES`, which the parser does not import
        help="the model's dtype; with MODEL_DIR too",
    )
    bench.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    bench.set_defaults(run=cmd_bench, parser=bench)

    demo = commands.add_parser(
        "demo", help="the model that ships in the package: answers and captions with early exit vs the full model"
    )
    demo.add_argument("model_dir", nargs="?", help="another calibrated model folder (default: the embedded one)")
    demo.add_argument("--output-dir", default="out/demo", help="where the exit picture goes")
    demo.add_argument(
        "--batch-size", type=positive_int, default=1, help="default 1: on a CPU, this small model's exits pay at 1"
    )
    demo.set_defaults(run=cmd_demo)

    publish = commands.add_parser(
        "publish", help="assemble a Hub-ready folder (remote code, card with measured numbers), validate, upload"
    )
    publish.add_argument("model_dir")
    publish.add_argument("--repo-id", required=True, help="user/name on the Hub")
    publish.add_argument("--private", action="store_true")
    publish.add_argument("--dry-run", action="store_true", help="assemble and validate only; print the folder")
    publish.add_argument("--output-dir", help="where the folder is assembled (default: the repo's name)")
    publish.add_argument("--token", help="Hub token (default: HF_TOKEN or `hf auth login`)")
    publish.add_argument(
        "--benchmark", nargs="+", help="files of `bench --json` lines (default MODEL_DIR/benchmark.jsonl)"
    )
    publish.add_argument("--plot", help="trade-off PNG for the card (default MODEL_DIR/tradeoff.png if present)")
    publish.add_argument("--datasets", help="card metadata: data set ids, comma-separated")
    publish.add_argument("--base-model", help="card metadata: the model this one was fine-tuned from")
    publish.add_argument("--license", help="card metadata: licence id (e.g. mit, apache-2.0)")
    publish.add_argument("--pipeline-tag", default="image-text-to-text")
    publish.set_defaults(run=cmd_publish)
    return parser


def cmd_publish(args: argparse.Namespace) -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    datasets = parse_list(args.datasets, str.strip, "--datasets takes comma-separated ids") if args.datasets else None
    published = publish(
        args.model_dir,
        args.repo_id,
        private=args.private,
        dry_run=args.dry_run,
        output_dir=args.output_dir,
        token=args.token,
        benchmark=args.benchmark,
        plot=args.plot,
        datasets=datasets,
        base_model=args.base_model,
        license=args.license,
        pipeline_tag=args.pipeline_tag,
        progress=True,
    )
    print(f"Assembled and validated {published.folder} (loads and generates without hf_earlyexit).")
    print(published.folder if args.dry_run else f"Published {published.url}")


def check_no_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An empty value ('') would read as "not given" (a default, a skipped plot, the embedded model): a ValueError
    names it, unless the option's help says what '' means there."""
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for action in commands.choices[args.command]._actions:
        given = getattr(args, action.dest, None) == "" != action.default
        if given and "''" not in (action.help or ""):
            name = action.option_strings[0] if action.option_strings else action.dest.upper()
            raise ValueError(f"{name} is empty: give a value, or leave it out.")


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: `torch.OutOfMemoryError` on an accelerator, a RuntimeError from
    the CPU allocator, or Python's own MemoryError."""
    import torch

    cpu_allocator = isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or cpu_allocator


def print_error(message: str) -> None:
    """One line on standard error, as promised, below any progress bar left open (closed so that the line starts
    on its own)."""
    from tqdm.auto import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    print(f"hf-earlyexit: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()  # the commands show their own progress; map and filter steps are noise
    try:
        check_no_empty_values(parser, args)
        args.run(args)
    except (ValueError, OSError, PublishError) as error:
        print_error(str(error))
        return 2
    except (MemoryError, RuntimeError) as error:
        if not out_of_memory(error):
            raise
        print_error(f"out of memory ({' '.join(str(error).split())[:200]}): try smaller sizes or batches")
        return 2
    except KeyboardInterrupt:
        resumable = args.command == "train" and any(Path(args.output_dir).glob("checkpoint-*/trainer_state.json"))
        print(f"\nhf-earlyexit: interrupted{' (continue with --resume)' if resumable else ''}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
