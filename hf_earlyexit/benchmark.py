"""Wall-clock benchmarks: do the layers an exit skips come back as time?

`forced_exit_benchmark` times, in one process and on the same inputs, three models that share their weights:
the full model, the same model made to exit after K layers (`FixedLayerExit`), and a model that simply *has* K
layers (truncated). The truncated model is the ideal: no early-exit implementation can beat a model without the
skipped layers, so `realized_over_ideal = truncated time / early-exit time` says how much of the saving the exit
machinery delivers (1.0 = all of it). The layer-count speedup L / K is reported beside it; it overstates the ideal,
because the embeddings, the final LayerNorm and the output projection (59k words) run whatever the depth.
At batch > 1 it also times scattered exits (`exit_patterns`) under each `row_exit` plan, each beside the full model
and its floor (every row stopping at the step's deepest exit: what no plan can beat when a layer costs the same for
any number of rows; asked through the same per-row controller, so that only the plan differs), and reports the
decoder's measured layer costs with the plan `auto` picks from them.

`task_benchmark` is the proof on a trained model: the full model and the early-exit model side by side on the same
test inputs, in one process, paired batch by batch and repeated (`paired_seconds`): quality, expected time reduction
(layers run, weighted by each part's cost per layer, measured on this machine in the same rounds by `PartCostRuns`,
and by FLOPs as MuE counts), the wall-clock ratio and per-part times; and, unless asked not to, the full model
compiled (`compiled_full_decoding`: a static cache, each decoding step one `torch.compile` graph), the fastest full
model a user could run instead, so that every speedup is also stated against it. `PartCostRuns` times each encoder
part at full depth and forced to exit after its first layer, and the decoder at full depth and forced to exit at its
first and last exit points: the differences are what layers cost, the rest what runs at any depth (the image stem,
embeddings, output projection and the `generate` loop) and what a decoding step with exits adds (its exit path).

`training_step_benchmark` times one training step (forward + backward) of the same model and batch under each exit
loss, interleaved, to show what training the exits costs against plain fine-tuning.
"""

import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping

import torch

from .evaluation import Asks, TaskInputs, TaskRun, flop_costs, run_batch, run_knobs, score, task_inputs
from .measures import (
    PartCosts,
    expected_time_reduction,
    full_depth_cost,
    parameter_speedup,
)
from .modeling.configuration_ofa import OFAEarlyExitConfig
from .modeling.exit_controllers import ExitController, ExitState, FixedLayerExit, checked_decision
from .modeling.exit_knobs import (
    DRAFTING_KNOBS,
    KV_STRATEGIES,
    NO_EXIT,
    ROW_EXIT_PLANS,
    encoder_exit_parts,
    shown_knobs,
)
from .modeling.generation_early_exit import EarlyExitSettings
from .modeling.modeling_ofa import EarlyExitOFAForConditionalGeneration
from .modeling.row_exits import timed_rounds

PROMPT_LENGTH = 8  # tokens, as in the official port's reference timings


def truncated_model(
    model: EarlyExitOFAForConditionalGeneration, encoder_layers: int, decoder_layers: int
) -> EarlyExitOFAForConditionalGeneration:
    """A model with only the first layers of `model`, sharing its weights (no copy, no random init)."""
    config = OFAEarlyExitConfig.from_dict(
        {**model.config.to_dict(), "encoder_layers": encoder_layers, "decoder_layers": decoder_layers}
    )
    with torch.device("meta"):
        truncated = EarlyExitOFAForConditionalGeneration(config)
    kept = truncated.state_dict().keys()
    truncated.load_state_dict({k: v for k, v in model.state_dict().items() if k in kept}, assign=True)
    truncated.config._attn_implementation = model.config._attn_implementation
    return truncated.eval()


def random_inputs(config: OFAEarlyExitConfig, batch: int, image_size: int, device, dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, min(50000, config.vocab_size), (batch, PROMPT_LENGTH), generator=generator)
    input_ids[:, 0], input_ids[:, -1] = config.bos_token_id, config.eos_token_id
    pixel_values = torch.randn(batch, 3, image_size, image_size, generator=generator)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": torch.ones_like(input_ids).to(device),
        "pixel_values": pixel_values.to(device, dtype),
    }


def checked_device(name: str) -> torch.device:
    """`name` as a torch.device; ValueError when it is malformed or absent on this machine."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"`device` must name a torch device (cpu, cuda, cuda:1, ...), got {name!r}.") from None
    if device.type == "cpu":
        return device
    available = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if available is None or device.type != available.type:
        have = f"the CPU and a {available.type} device" if available is not None else "the CPU alone (no accelerator)"
        raise ValueError(f"Device {name}: this machine has {have}.")
    if device.index is not None and device.index >= torch.accelerator.device_count():
        raise ValueError(f"Device {name}: this machine has {torch.accelerator.device_count()} {device.type} devices.")
    return device


DTYPES = ("float32", "bfloat16", "float16")  # what a benchmark times in


def checked_dtype(name: str) -> torch.dtype:
    """`name` (one of `DTYPES`) as a torch.dtype; ValueError otherwise."""
    if name not in DTYPES:
        raise ValueError(f"`dtype` must be one of {list(DTYPES)}, got {name!r}.")
    return getattr(torch, name)


def device_name(device: torch.device) -> str:
    """The GPU's name, the CPU with its thread count, or another device as torch names it (what a timing ran on)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)


def timed_on(model) -> dict[str, str]:
    """Where a loaded model's timings run: its device's name and its dtype, as the reports record them."""
    return {"device": device_name(model.device), "dtype": str(model.dtype).removeprefix("torch.")}


def median_seconds(
    functions: dict[str, Callable[[], object]], repeats: int, device: torch.device, progress: str | None = None
) -> dict[str, float]:
    """Median wall-clock of each function: `paired_seconds` with one batch."""
    return paired_seconds({name: lambda _, f=f: f() for name, f in functions.items()}, 1, repeats, device, progress)


@torch.no_grad()
def forced_exit_benchmark(
    forced_exit: int,
    preset: str = "base",
    batch_sizes: tuple[int, ...] = (1, 8),
    encoder_batch_size: int = 1,
    new_tokens: int = 16,
    image_size: int = 384,
    repeats: int = 3,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    progress: bool = False,
) -> dict:
    """Time full, forced-exit and truncated models (random weights of `preset` size); returns a JSON-ready dict.
    `progress`: a progress bar over the stages (the two encoders, then each batch size)."""
    from tqdm.auto import tqdm

    torch_device, torch_dtype = checked_device(str(device)), checked_dtype(dtype)
    if not batch_sizes or any(size < 1 for size in (*batch_sizes, encoder_batch_size, new_tokens, repeats)):
        raise ValueError(
            "`batch_sizes` (at least one), `encoder_batch_size`, `new_tokens` and `repeats` must be positive."
        )
    torch.manual_seed(0)
    config = OFAEarlyExitConfig.from_preset(preset)
    if not 1 <= forced_exit < min(config.encoder_layers, config.decoder_layers):
        depth = min(config.encoder_layers, config.decoder_layers)
        raise ValueError(
            f"`--forced-exit` must lie in [1, {depth - 1}] for OFA-{preset} ({config.encoder_layers} encoder / "
            f"{config.decoder_layers} decoder layers), got {forced_exit}."
        )
    if new_tokens > config.max_position_embeddings:  # `generate` would stop there, and ms per token would lie
        raise ValueError(
            f"`--new-tokens` must be at most {config.max_position_embeddings} for OFA-{preset} (its decoder's "
            f"positions, `max_position_embeddings`), got {new_tokens}."
        )
    model = EarlyExitOFAForConditionalGeneration(config).to(torch_device, torch_dtype).eval()
    truncated = truncated_model(model, forced_exit, forced_exit)
    exit_after = FixedLayerExit(forced_exit)
    report = {
        "model": f"OFA-{preset} (random weights)",
        "device": device_name(torch_device),
        "dtype": dtype,
        "image_size": image_size,
        "prompt_tokens": PROMPT_LENGTH,
        "forced_exit": forced_exit,
        "repeats": repeats,
        "encoder": {},
        "decoder": {},
        "decoder_patterns": {},
        "decoder_plan": {},
    }

    stages = tqdm(total=2 + len(batch_sizes), desc=f"timing OFA-{preset}", disable=not progress)
    inputs = random_inputs(config, encoder_batch_size, image_size, torch_device, torch_dtype)
    for mode, decomposed, parts in (
        ("joint", False, ("encoder",)),
        ("decomposed", True, ("encoder_image", "encoder_text")),
    ):
        model.config.decompose_encoder_modalities = truncated.config.decompose_encoder_modalities = decomposed
        settings = EarlyExitSettings(**dict.fromkeys(parts, exit_after))
        seconds = median_seconds(
            {
                "full": lambda: model.get_encoder()(**inputs),
                "early_exit": lambda settings=settings: model.get_encoder()(**inputs, exit_settings=settings),
                "truncated": lambda: truncated.get_encoder()(**inputs),
            },
            repeats,
            torch_device,
        )
        report["encoder"][mode] = summary(seconds, forced_exit / config.encoder_layers, encoder_batch_size, "s")
        stages.update()
    model.config.decompose_encoder_modalities = truncated.config.decompose_encoder_modalities = False

    for batch in batch_sizes:
        inputs = random_inputs(config, batch, image_size, torch_device, torch_dtype)
        encoder_outputs = model.get_encoder()(**inputs)

        def decode(generator, encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], **knobs):
            # A fixed number of new tokens, so every variant decodes the same length.
            return lambda: generator.generate(
                encoder_outputs=encoder_outputs,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **knobs,
            )

        functions = {"full": decode(model), "truncated": decode(truncated)}
        for strategy in KV_STRATEGIES:
            functions[strategy] = decode(model, exit_controller=exit_after, kv_strategy=strategy)
        seconds = {name: value / new_tokens for name, value in median_seconds(functions, repeats, torch_device).items()}
        patterns = exit_patterns(forced_exit, config.decoder_layers, batch)
        report["decoder_patterns"][f"batch_{batch}"] = {}
        for name, layers in patterns.items():  # each pattern timed beside its own full model and floor
            deepest, layers = int(layers.max()), layers.to(torch_device)
            floor = per_row_exit(torch.full_like(layers, deepest))  # asked as the pattern is: only the plan differs
            timed = {"full": decode(model), "floor": decode(model, exit_controller=floor)}
            for row_exit in ROW_EXIT_PLANS:
                timed[row_exit] = decode(model, exit_controller=per_row_exit(layers), row_exit=row_exit)
            rounds = round_seconds({key: lambda _, f=f: f() for key, f in timed.items()}, 0, repeats, torch_device)
            report["decoder_patterns"][f"batch_{batch}"][name] = pattern_summary(rounds, deepest, new_tokens)
        if batch > 1:
            report["decoder_plan"][f"batch_{batch}"] = plan_report(model, encoder_outputs, batch)
        report["decoder"][f"batch_{batch}"] = {
            strategy: summary(
                {"full": seconds["full"], "early_exit": seconds[strategy], "truncated": seconds["truncated"]},
                forced_exit / config.decoder_layers,
                batch,
                "ms_per_token",
            )
            for strategy in KV_STRATEGIES
        }
        stages.update()
    stages.close()
    return report


def exit_patterns(forced_exit: int, depth: int, batch: int) -> dict[str, torch.Tensor]:
    """Where each row of a batch exits, beside "every row after `forced_exit`": name -> each row's exit layer
    [batch] (`depth`: it runs every layer). None at batch 1, where each is a uniform exit."""
    if batch == 1:
        return {}
    rows = torch.arange(batch)
    return {
        "alternating": torch.where(rows % 2 == 0, forced_exit, depth),
        "one_row_deep": torch.where(rows == 0, depth, forced_exit),
        "each_row_own_layer": 1 + rows % 3,
    }


def per_row_exit(layers: torch.Tensor) -> FixedLayerExit:
    """Each running row exits after its layer in `layers` [batch]: one lookup per question, whatever the pattern, so
    that a pattern and its floor pay the same for being asked (on a GPU each operation costs a launch)."""
    return FixedLayerExit(lambda state: layers[state.rows])


def pattern_summary(rounds: dict[str, list[float]], deepest: int, new_tokens: int) -> dict:
    """One pattern's median milliseconds per step: the full model, the floor (every row stopping at the step's
    deepest exit) and each plan; and the median over rounds of each plan's ratio, within the round, to the full
    model (speedup, >= 1 = never slower) and to the floor. Ratios within a round keep the machine's drift out."""

    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    summary = {"deepest_exit": deepest}
    for name in ("full", "floor", *ROW_EXIT_PLANS):
        summary[f"{name}_ms_per_token"] = median([1000 * value / new_tokens for value in rounds[name]])
    for row_exit in ROW_EXIT_PLANS:
        times = rounds[row_exit]
        summary[f"{row_exit}_speedup_over_full"] = median([f / t for f, t in zip(rounds["full"], times, strict=True)])
        summary[f"{row_exit}_over_floor"] = median([t / f for t, f in zip(times, rounds["floor"], strict=True)])
    return summary


def plan_report(model, encoder_outputs, batch: int) -> dict:
    """The decoder's measured layer costs at this batch (ms) and what `auto` picks when one row, or half the rows,
    go on."""
    decoder = model.get_decoder()
    source = encoder_outputs.last_hidden_state
    costs = decoder.layer_costs(batch, 1, source.shape[1], source.dtype)
    return {
        "rows": list(costs.rows),
        "kept_layer_ms": [round(value * 1000, 3) for value in costs.kept],
        "compacted_layer_ms": [round(value * 1000, 3) for value in costs.compacted],
        "gather_ms": round(costs.gather * 1000, 3),
        **{
            f"auto_with_{going_on}_of_{batch}_going_on": "compact" if costs.compact_pays(batch, going_on) else "keep"
            for going_on in sorted({1, batch // 2})
        },
    }


def training_step_benchmark(
    preset: str | OFAEarlyExitConfig = "base",
    exit_losses: tuple[str, ...] = ("none", "layerwise"),
    batch_size: int = 8,
    image_size: int = 384,
    target_length: int = 16,
    repeats: int = 3,
    progress: bool = False,
) -> dict:
    """Median seconds of one training step (forward + backward, no optimizer step: that is the same for every
    loss) per exit loss, on one random batch and one model of `preset` size (a preset name or a config); ratios
    are against "none". `progress`: a progress bar while it times."""
    from .trainers import EarlyExitTrainer, EarlyExitTrainingArguments

    if "none" not in exit_losses:
        raise ValueError(f"The exit losses to time must include 'none' (the baseline), got {list(exit_losses)}.")
    torch.manual_seed(0)
    config = OFAEarlyExitConfig.from_preset(preset, dropout=0.0) if isinstance(preset, str) else preset
    model = EarlyExitOFAForConditionalGeneration(config)
    inputs = random_inputs(config, batch_size, image_size, torch.device("cpu"), torch.float32)
    labels = torch.randint(
        4, min(50000, config.vocab_size), (batch_size, target_length), generator=torch.Generator().manual_seed(1)
    )
    inputs["labels"] = labels
    tokens = inputs["labels"].numel()
    with tempfile.TemporaryDirectory() as output_dir:
        trainers = {
            loss: EarlyExitTrainer(
                model=model,
                args=EarlyExitTrainingArguments(output_dir=output_dir, exit_loss=loss, report_to="none", use_cpu=True),
            )
            for loss in exit_losses
        }

        def step(trainer: EarlyExitTrainer) -> None:
            model.zero_grad(set_to_none=True)
            trainer.training_step(model, inputs, num_items_in_batch=tokens)

        seconds = median_seconds(
            {loss: lambda trainer=trainer: step(trainer) for loss, trainer in trainers.items()},
            repeats,
            torch.device("cpu"),
            f"timing a training step per exit loss ({repeats} rounds after a warm-up)" if progress else None,
        )
    return {
        "model": f"OFA-{preset} (random weights)" if isinstance(preset, str) else "the given config (random weights)",
        "device": f"cpu ({torch.get_num_threads()} threads)",
        "batch_size": batch_size,
        "image_size": image_size,
        "target_tokens": target_length,
        "repeats": repeats,
        "seconds_per_step": {loss: round(value, 4) for loss, value in seconds.items()},
        "ratio_to_none": {loss: round(value / seconds["none"], 3) for loss, value in seconds.items()},
    }


class AskOnly(ExitController):
    """`controller`'s test after every exit point, without ever stopping a row: what its asks cost."""

    def __init__(self, controller: ExitController):
        self.controller = controller

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        return torch.zeros_like(checked_decision(self.controller(state), state, self.controller))

    def reset(self) -> None:
        self.controller.reset()


class PartCostRuns:
    """The runs whose seconds give `PartCosts`: each part at full depth and forced to exit early, per batch of
    `inputs`, so that they can join the rounds of `paired_seconds` beside the runs they price
    (`task_benchmark`) or be timed alone (`measure_part_costs`). Decoding has a fixed length per batch, the full
    model's own greedy length for it (`lengths`): a step's cost grows with the tokens before it, so decoding to
    `max_new_tokens` would price the steps of a short output as those of a long one.

    functions: name -> run on batch `index`: the encoder, each stream after its first layer, the decoder at full
        depth and forced to stop every row at its first and at its last exit point (`exit_depths`), and, asking a
        controller after every layer or exit point without ever stopping (`AskOnly`): the decoder for each policy ->
        controller of `askers`, the encoder for each part -> controller of `encoder_askers`.
    """

    def __init__(
        self,
        model,
        inputs: TaskInputs,
        askers: Mapping[str, ExitController] | None = None,
        encoder_askers: Mapping[str, ExitController] | None = None,
    ):
        config, encoder = model.config, model.get_encoder()
        self.config, self.inputs, self.askers = config, inputs, dict(askers or {})
        self.encoder_askers = dict(encoder_askers or {})
        self.parts = encoder_exit_parts(config)
        first_layer = FixedLayerExit(1)
        with torch.no_grad():
            encoder_outputs = [encoder(**batch) for batch in inputs.batches]

        def generate(index: int, length: int | None = None, **knobs):
            lengths = {"min_new_tokens": length} if length else {}
            return model.generate(
                encoder_outputs=encoder_outputs[index], attention_mask=inputs.batches[index]["attention_mask"],
                **{**NO_EXIT, **knobs}, max_new_tokens=length or inputs.task.max_new_tokens, **lengths,
                do_sample=False, num_beams=1,
            )  # fmt: skip

        self.lengths = [generate(index).shape[1] - 1 for index in range(len(inputs.batches))]  # after the start token

        def encode(controllers: dict[str, ExitController]):
            settings = EarlyExitSettings(**controllers)
            return torch.no_grad()(lambda index: encoder(**inputs.batches[index], exit_settings=settings))

        def decode(knobs: dict):
            return lambda index: generate(index, self.lengths[index], **knobs)

        functions = {"encoder": encode({}), **{part: encode({part: first_layer}) for part in self.parts}}
        functions |= {f"{part} asking": encode({part: AskOnly(c)}) for part, c in self.encoder_askers.items()}
        # Decoding forced to exit at the first and at the last exit point, asked there only: both pay the exit path
        # (its rows, one test, the stop), so their difference is layers alone; the full model pays none of it.
        self.exit_depths = shallow, deep = config.exit_points[0], config.exit_points[-1]
        forced = {"decoder_shallow": shallow} | ({"decoder_deep": deep} if deep > shallow else {})
        functions |= {"decoder": decode({})}
        functions |= {
            name: decode({"exit_controller": FixedLayerExit(layer), "min_exit_layer": layer})
            for name, layer in forced.items()
        }
        askers = self.askers.items()
        functions |= {f"decoder asking {policy}": decode({"exit_controller": AskOnly(c)}) for policy, c in askers}
        self.functions = {f"part cost: {name}": function for name, function in functions.items()}

    def costs(self, seconds: Mapping[str, float]) -> PartCosts:
        """Seconds per sample of one layer of each encoder stream (or of the joint encoder) and of the image stem +
        embeddings, and of one test of each encoder asker's controller after a layer; seconds per generated token of
        one decoder layer, of the rest of a decoding step, of the exit path of a step with exits and of one test of
        each asker's controller after a layer; from `seconds` (name -> seconds over every batch, as
        `paired_seconds` gives, for at least the names of `functions`). With "full" among them (the full model's
        whole `generate` calls on the same batches, timed in the same rounds), also `call_fixed`: what those calls
        took beyond what the parts explain, per sample (none when the parts explain more)."""
        seconds = {name.removeprefix("part cost: "): value for name, value in seconds.items()}
        config, parts = self.config, self.parts
        samples = self.inputs.samples
        generated = sum(len(batch["input_ids"]) * n for batch, n in zip(self.inputs.batches, self.lengths, strict=True))
        asks = generated * len(config.exit_points)
        encoder_layers, decoder_layers = config.encoder_layers, config.decoder_layers
        per_layer = {p: max(0.0, seconds["encoder"] - seconds[p]) / (encoder_layers - 1) / samples for p in parts}
        shallow, deep = self.exit_depths
        if deep > shallow:
            decoder = max(0.0, seconds["decoder_deep"] - seconds["decoder_shallow"]) / (deep - shallow) / generated
        else:  # one exit point: the layers above it against the full model, exit path included
            decoder = max(0.0, seconds["decoder"] - seconds["decoder_shallow"]) / (decoder_layers - shallow) / generated
        decoder_fixed = max(0.0, seconds["decoder"] / generated - decoder_layers * decoder)
        encoder_layer = sum(per_layer.values())
        costs = PartCosts(
            encoder_image=per_layer[parts[0]],
            encoder_text=per_layer.get("encoder_text", 0.0),
            decoder=decoder,
            encoder_fixed=max(0.0, seconds["encoder"] / samples - encoder_layers * encoder_layer),
            decoder_fixed=decoder_fixed,
            decoder_exit_path=max(0.0, seconds["decoder_shallow"] / generated - shallow * decoder - decoder_fixed),
            decoder_asks={p: max(0.0, seconds[f"decoder asking {p}"] - seconds["decoder"]) / asks for p in self.askers},
            encoder_asks={
                part: max(0.0, seconds[f"{part} asking"] - seconds["encoder"]) / (encoder_layers - 1) / samples
                for part in self.encoder_askers
            },
        )
        if "full" not in seconds:
            return costs
        explained = full_depth_cost(costs, samples, generated, encoder_layers, decoder_layers)
        return dataclasses.replace(costs, call_fixed=max(0.0, seconds["full"] - explained) / samples)


def measure_part_costs(
    model,
    processor,
    inputs: TaskInputs,
    repeats: int = 3,
    samples: int = 32,
    askers: Mapping[str, ExitController] | None = None,
    encoder_askers: Mapping[str, ExitController] | None = None,
) -> PartCosts:
    """`PartCostRuns` on the first `samples` rows of `inputs`, with the full model's whole calls (`call_fixed`),
    timed alone: costs per row and token are averages, steady long before a whole split (but they move with the
    machine: `task_benchmark` times them in its own rounds instead)."""
    runs = PartCostRuns(model, inputs.split_at(samples)[0], askers, encoder_askers)
    batches, task = runs.inputs.batches, runs.inputs.task
    functions = runs.functions | {"full": lambda index: run_batch(model, processor, task, batches[index])}
    return runs.costs(paired_seconds(functions, len(batches), repeats, model.device))


def paired_seconds(
    functions: dict[str, Callable[[int], object]],
    batches: int,
    repeats: int,
    device: torch.device,
    progress: str | None = None,
) -> dict[str, float]:
    """Seconds of each function over batches 0..batches-1: per batch, every function back to back, `repeats` rounds
    after a warm-up round, the order reversed in every other round; the sum over batches of each batch's median.
    Pairing at the batch, milliseconds apart, keeps a shared machine's drift out of the ratios: on ours, whole-split
    runs minutes apart moved by up to 20%. `progress`: a progress bar's description (None: no bar)."""
    from tqdm.auto import tqdm

    seconds = dict.fromkeys(functions, 0.0)
    for index in tqdm(range(batches), desc=progress, disable=progress is None):
        for name, values in round_seconds(functions, index, repeats, device).items():
            seconds[name] += statistics.median(values)
    return seconds


def round_seconds(
    functions: dict[str, Callable[[int], object]], index: int, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each function on batch `index` in each of `repeats` rounds, after a warm-up round; every round runs
    them all back to back, the order reversed in every other round (`row_exits.timed_rounds`)."""
    calls = [functools.partial(function, index) for function in functions.values()]
    return dict(zip(functions, timed_rounds(calls, device, repeats), strict=True))


def compiled_full_decoding() -> dict:
    """`generate` arguments that decode the full model compiled: a static cache, and every decoding step one graph
    (`fullgraph=True`, so a graph break is an error, not a slow run). The warm-up round of `paired_seconds` pays for
    the compilation (tens of seconds on a CPU), and each new batch shape recompiles there too."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # Transformers' flag to compile on a CPU too (by default, GPUs only)
    return {"cache_implementation": "static", "compile_config": config}


def task_benchmark(
    model,
    processor,
    inputs: TaskInputs,
    knobs: dict,
    repeats: int = 3,
    meteor: bool = False,
    speculative: dict | None = None,
    progress: str | None = None,
    compiled_full: bool = False,
    round_shares: bool = True,
) -> dict:
    """Full model vs `knobs` on the same inputs (`paired_seconds`): quality, expected time reduction, wall clock,
    tokens per second, per-part times; with `speculative` (knobs with `exit_mode="speculative"`), that mode too,
    timed in the same rounds (`speculative_report`); with `compiled_full`, the full model compiled
    (`compiled_full_decoding`) too, and each mode's speedup over it. `progress`: the description of a progress bar
    over the batches (None: none). `round_shares`: profile where a speculative round's time goes (a run more).
    Returns the JSON object `hf-earlyexit bench --json` prints."""
    config, settings = model.config, {"full": {}, "early_exit": knobs}
    decoding = {"full_compiled": compiled_full_decoding()} if compiled_full else {}  # beyond the knobs, per run
    if speculative is not None:
        settings["speculative"] = speculative
    if compiled_full:
        settings["full_compiled"] = {}
    batch_runs: dict[str, list[TaskRun | None]] = {name: [None] * len(inputs.batches) for name in settings}

    def generate(name: str) -> Callable[[int], None]:
        def run(index: int) -> None:  # every round decodes the same; the last one's outputs are scored
            batch, extra = inputs.batches[index], decoding.get(name, {})
            batch_runs[name][index] = run_batch(model, processor, inputs.task, batch, settings[name], **extra)

        return run

    asks = Asks.of(model, knobs)
    askers = {asks.policy: asks.controller} if asks.controller is not None else {}
    part_runs = PartCostRuns(model, inputs, askers, asks.encoder_controllers)
    # The part costs are timed in the same rounds as the runs they price, on the same batches: timed apart, they
    # moved with the machine while the paired clock did not (captions' measured reduction spanned 22-31% on
    # identical exit layers).
    functions = {name: generate(name) for name in settings} | part_runs.functions
    seconds = paired_seconds(functions, len(inputs.batches), repeats, model.device, progress)
    runs = {name: TaskRun.concatenate(batches) for name, batches in batch_runs.items()}
    batch_size = inputs.batches[0]["input_ids"].shape[0]
    costs = part_runs.costs(seconds)  # "full" among them: the call's fixed cost too
    flops = flop_costs(model, inputs)

    def reduction(run, part_costs: PartCosts, batch: int = batch_size) -> float:
        return expected_time_reduction(
            run.encoder_exit_layers,
            run.decoder_exit_layers,
            part_costs,
            config.encoder_layers,
            config.decoder_layers,
            batch,
            asks.layers,
            asks.policy,
            asks.encoder_layers,
        )

    def side(name: str) -> dict:
        run = runs[name]
        scores = score(inputs.task, run.predictions, inputs.targets, meteor=meteor)
        generated = run.decoder_exit_layers[run.decoder_exit_layers > 0].double()
        return {
            "quality": scores[inputs.task.quality_key],
            "seconds": seconds[name],
            "tokens_per_second": round(run.tokens / seconds[name], 2),
            "scores": scores,
            "mean_layers": {
                "encoder_image": round(float(run.encoder_exit_layers[:, 0].double().mean()), 3),
                "encoder_text": round(float(run.encoder_exit_layers[:, 1].double().mean()), 3),
                "decoder_per_token": round(float(generated.mean()), 3),
            },
        }

    full, early = side("full"), side("early_exit")
    early["expected_time_reduction"] = round(reduction(runs["early_exit"], costs), 4)
    early["expected_time_reduction_flops"] = round(reduction(runs["early_exit"], flops), 4)
    early["expected_time_reduction_per_row"] = round(reduction(runs["early_exit"], costs, 1), 4)
    early["parameter_speedup"] = round(parameter_speedup(model, runs["early_exit"].decoder_exit_layers), 4)
    early["settings"] = shown_knobs(knobs)
    report = {
        "task": inputs.task.name,
        "metric": inputs.task.quality_key,
        "samples": inputs.samples,
        "batch_size": batch_size,
        **timed_on(model),
        "repeats": repeats,
        "full": full,
        "early_exit": early,
        "quality_ratio": round(early["quality"] / full["quality"], 4) if full["quality"] else None,
        "wall_clock_time_reduction": round(1 - seconds["early_exit"] / seconds["full"], 4),
        "per_part_seconds": {
            "encoder_image_layer_per_sample": costs.encoder_image,
            "encoder_text_layer_per_sample": costs.encoder_text,
            "encoder_fixed_per_sample": costs.encoder_fixed,
            "call_fixed_per_sample": costs.call_fixed,
            "decoder_layer_per_token": costs.decoder,
            "decoder_fixed_per_token": costs.decoder_fixed,
            "decoder_ask_per_token": costs.ask_cost(asks.policy),
            "decoder_exit_path_per_token": costs.decoder_exit_path,
            "decoder_layers_asked": list(asks.layers),
            "encoder_ask_per_sample": {part: costs.encoder_ask_cost(part) for part in asks.encoder_layers},
            "encoder_layers_asked": {part: list(layers) for part, layers in asks.encoder_layers.items()},
        },
    }
    if speculative is not None:
        report["speculative"] = {**side("speculative"), **speculative_report(runs, seconds)}
        if round_shares:
            report["speculative"]["round_time_shares"] = round_time_shares(model, processor, inputs, speculative)
        report["speculative"]["settings"] = shown_knobs(speculative)
    if compiled_full:
        report["full_compiled"] = {
            **side("full_compiled"),
            "same_outputs_as_full": runs["full_compiled"].predictions == runs["full"].predictions,
            "speedup_over_full": round(seconds["full"] / seconds["full_compiled"], 3),
        }
        for name in report.keys() & {"early_exit", "speculative"}:
            report[name]["speedup_over_compiled_full"] = round(seconds["full_compiled"] / seconds[name], 3)
    return report


def speculative_report(runs: dict[str, TaskRun], seconds: dict[str, float]) -> dict:
    """Speculative mode against the full model: whether its outputs are the full model's, its speedup, and how its
    drafts fared (per round: drafts, then one verification; None where no call drafted, having more rows than
    `draft_max_batch_size`)."""
    run, full = runs["speculative"], runs["full"]
    return {
        "same_outputs_as_full": run.predictions == full.predictions,
        "speedup_over_full": round(seconds["full"] / seconds["speculative"], 3),
        "acceptance_rate": round(run.accepted / run.drafted, 4) if run.drafted else None,
        "accepted_per_round": round(run.accepted / run.rounds, 3) if run.rounds else None,
        "tokens_per_round": round(run.tokens / run.rounds, 3) if run.rounds else None,
    }


@contextlib.contextmanager
def native_stderr_closed():
    """The process's standard error sent nowhere: PyTorch's profiler (Kineto) prints its start and stop there from
    C++, into the reports of `bench` and `demo`."""
    sys.stderr.flush()
    kept = os.dup(2)
    with open(os.devnull, "w") as nowhere:
        os.dup2(nowhere.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)


def round_time_shares(model, processor, inputs: TaskInputs, knobs: dict, samples: int = 32) -> dict | None:
    """Where speculative mode's rounds spend their time, from one more pass over the first `samples` samples under
    `torch.profiler` (which slows it, so shares, not seconds; and it keeps every op's record, so not the whole
    split): drafting, verification, and the rest (acceptance, logits processors, bookkeeping), with the
    verification's milliseconds per round under the profiler; None when no round ran (no call drafted)."""
    batches = inputs.batches[: max(1, samples // inputs.batches[0]["input_ids"].shape[0])]
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with native_stderr_closed():
        profiler.start()
    try:
        for batch in batches:
            run_batch(model, processor, inputs.task, batch, knobs)
    finally:
        with native_stderr_closed():
            profiler.stop()
    events = {event.key: event for event in profiler.key_averages() if event.key.startswith("speculative.")}
    if "speculative.round" not in events:  # more rows than `draft_max_batch_size`: the full model decoded
        return None
    total = events["speculative.round"].cpu_time_total
    draft, verify = (events[f"speculative.{part}"].cpu_time_total for part in ("draft", "verify"))
    return {
        "draft": round(draft / total, 3),
        "verification": round(verify / total, 3),
        "bookkeeping": round(1 - (draft + verify) / total, 3),
        "verification_ms_per_round_profiled": round(verify / events["speculative.verify"].count / 1000, 3),
    }


def model_benchmark(
    model,
    processor,
    task: str,
    knobs: dict,
    samples: int = 100,
    batch_size: int = 1,
    repeats: int = 2,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    meteor: bool = False,
    compiled_full: bool = True,
) -> dict:
    """`task_benchmark` of a loaded model with `knobs` on task `task`'s first `samples` test rows, with the model
    moved to `device` and `dtype`, beside the compiled full model unless `compiled_full=False`. ValueError when
    `knobs` make no part exit."""
    torch_device, torch_dtype = checked_device(str(device)), checked_dtype(dtype)
    speculative = None
    if knobs.get("exit_mode") == "speculative":  # beside the lossy exits of the same settings and saved defaults
        speculative = knobs
        knobs = run_knobs(model, **{**{k: v for k, v in knobs.items() if k not in DRAFTING_KNOBS}, "exit_mode": "exit"})
    if not EarlyExitSettings.from_knobs(model.config, **knobs).exits:
        beside = " (timed beside speculative mode)" if speculative is not None else ""
        raise ValueError(
            f"No exit setting for the lossy exits{beside}: give an exit threshold, or calibrate the model "
            "(`hf-earlyexit calibrate --write`)."
        )
    model.to(device=torch_device, dtype=torch_dtype)
    inputs = task_inputs(task, processor, "test", samples, batch_size, model.device)
    progress = f"timing {task} ({len(inputs.batches)} batches)"
    return task_benchmark(model, processor, inputs, knobs, repeats, meteor, speculative, progress, compiled_full)


def summary(seconds: dict[str, float], layer_ratio: float, batch: int, unit: str) -> dict:
    scale = 1000.0 if unit == "ms_per_token" else 1.0
    return {
        "batch": batch,
        f"full_{unit}": round(seconds["full"] * scale, 4),
        f"early_exit_{unit}": round(seconds["early_exit"] * scale, 4),
        f"truncated_{unit}": round(seconds["truncated"] * scale, 4),
        "realized_speedup": round(seconds["full"] / seconds["early_exit"], 3),
        "ideal_speedup": round(seconds["full"] / seconds["truncated"], 3),
        "layer_count_speedup": round(1 / layer_ratio, 3),
        "realized_over_ideal": round(seconds["truncated"] / seconds["early_exit"], 3),
    }


__all__ = [
    "PartCostRuns",
    "checked_device",
    "compiled_full_decoding",
    "forced_exit_benchmark",
    "measure_part_costs",
    "model_benchmark",
    "paired_seconds",
    "task_benchmark",
    "training_step_benchmark",
    "truncated_model",
]
