"""The early-exit knobs: their names, types, defaults and checks, and the one place they are resolved.

A knob (`exit_threshold=0.9`, `kv_strategy="copy"`, ...) is looked up in the `generate` call, then in the generation
config (where calibration writes its choice), then in the model config (the model's own defaults), then here.
`generate`, the config, the CLI, evaluation, calibration and publishing all go through `resolve_knobs` (or
`saved_knobs`, its lookup without a call) and `check_knobs`; `NO_EXIT` is the one way to ask for the full model
whatever the saved defaults say.

A leaf: it imports nothing of the model (only Transformers' logger), so the config and the exit controllers can both
read it.
"""

import difflib
import functools
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

from transformers.utils import logging

logger = logging.get_logger(__name__)

ExitPolicy = Literal["similarity", "confidence", "margin", "patience", "fixed_layer"]
ThresholdScheduleName = Literal["constant", "mue_decay", "mue_official", "calm_decay"]
KVStrategy = Literal["propagate", "copy", "recompute"]
ExitPart = Literal["decoder", "encoder", "encoder_image", "encoder_text"]
RowExitPlan = Literal["auto", "keep", "compact"]
ExitTokenLayer = Literal["own", "batch"]
ExitMode = Literal["exit", "speculative"]

POLICY_NAMES: tuple[str, ...] = get_args(ExitPolicy)
# Policies whose threshold is a whole number of layers, one for the whole batch: patience's count of agreeing exit
# points, and the fixed layer every row exits after.
LAYER_POLICIES: tuple[str, ...] = ("patience", "fixed_layer")
SCHEDULE_NAMES: tuple[str, ...] = get_args(ThresholdScheduleName)
KV_STRATEGIES: tuple[str, ...] = get_args(KVStrategy)
EXIT_PARTS: tuple[str, ...] = get_args(ExitPart)
ROW_EXIT_PLANS: tuple[str, ...] = get_args(RowExitPlan)
EXIT_TOKEN_LAYERS: tuple[str, ...] = get_args(ExitTokenLayer)
EXIT_MODES: tuple[str, ...] = get_args(ExitMode)
# Parts of the encoder a controller can be given for: the joint encoder, or each stream of a decomposed one.
ENCODER_PARTS: tuple[str, ...] = EXIT_PARTS[1:]


def encoder_exit_parts(config: Any) -> tuple[str, ...]:
    """The encoder parts of `config`'s model that exit on their own: each modality stream of a decomposed encoder
    (`decompose_encoder_modalities`), or the joint encoder."""
    return ("encoder_image", "encoder_text") if config.decompose_encoder_modalities else ("encoder",)


# Knob -> default. All but `exit_controller` (an object) are JSON values kept in the config / generation config:
# scalars, and `draft_vocabulary`'s list of token ids.
EXIT_KNOBS: dict[str, Any] = {
    "exit_threshold": None,
    "exit_policy": "similarity",
    "exit_threshold_schedule": "constant",
    "exit_controller": None,
    "encoder_exit_threshold": None,
    "encoder_image_exit_threshold": None,
    "encoder_text_exit_threshold": None,
    "kv_strategy": "propagate",
    "min_exit_layer": 1,
    "max_exit_layer": None,
    "encoder_min_exit_layer": 1,
    "row_exit": "auto",
    "exit_token_layer": "own",
    "batch_stop_fraction": 1.0,
    "exit_mode": "exit",
    "draft_exit_policy": None,
    "draft_exit_threshold": None,
    "draft_max_batch_size": None,
    "draft_vocabulary": None,
}
# Every knob at its default, i.e. no part exits: passed on top of saved defaults, it asks for the full model.
NO_EXIT: dict[str, Any] = dict(EXIT_KNOBS)

# What speculative mode runs with, whatever the saved defaults say: its output is the full model's.
SPECULATIVE_KNOBS: dict[str, Any] = {
    **{f"{part}_exit_threshold": None for part in ENCODER_PARTS},
    "kv_strategy": "recompute",
    "row_exit": "compact",
    "exit_token_layer": "own",
    "max_exit_layer": None,
}

# Speculative mode's own decoder exit; None: the decoder's (`exit_policy`, `exit_threshold`).
DRAFT_KNOBS: tuple[str, ...] = ("draft_exit_policy", "draft_exit_threshold")
# The knobs only speculative mode reads: its drafts' exit, the batch size it drafts up to, and their vocabulary.
DRAFTING_KNOBS: tuple[str, ...] = (*DRAFT_KNOBS, "draft_max_batch_size", "draft_vocabulary")

# Named choices: knob -> its choices.
CHOICES: dict[str, tuple[str, ...]] = {
    "exit_policy": POLICY_NAMES,
    "exit_threshold_schedule": SCHEDULE_NAMES,
    "kv_strategy": KV_STRATEGIES,
    "row_exit": ROW_EXIT_PLANS,
    "exit_token_layer": EXIT_TOKEN_LAYERS,
    "exit_mode": EXIT_MODES,
    "draft_exit_policy": (*POLICY_NAMES, None),  # None: `exit_policy`
}
# Layer knobs: knob -> the config field that bounds it (`max_exit_layer` may also be None: no bound).
LAYER_BOUNDS: dict[str, str] = {
    "min_exit_layer": "decoder_layers",
    "max_exit_layer": "decoder_layers",
    "encoder_min_exit_layer": "encoder_layers",
}
# Threshold knobs: knob -> its range (None: the decoder's, checked by its policy's controller).
THRESHOLD_RANGES: dict[str, tuple[float, float] | None] = {
    "exit_threshold": None,
    "draft_exit_threshold": None,
    **{f"{part}_exit_threshold": (-1.0, 1.0) for part in ENCODER_PARTS},  # cosine similarities
}
# A decoder threshold's range is its policy's score's (`LAYER_POLICIES` count layers, checked apart).
POLICY_RANGES: dict[str, tuple[float, float]] = {
    "similarity": (-1.0, 1.0),
    "confidence": (0.0, 1.0),
    "margin": (0.0, 1.0),
}


def check_knobs(values: dict[str, Any], config: Any, resolved: bool = True) -> None:
    """Type and range checks of the JSON knobs in `values` against `config`'s depths; a ValueError names the knob.
    `resolved`: `values` are what a call runs with, so a decoder threshold must lie in its policy's range; a model
    config's own knobs (not resolved: a generation config may set another policy) need only be finite."""
    for name, choices in CHOICES.items():
        if name in values and values[name] not in choices:
            raise ValueError(f"Unknown `{name}` {values[name]!r}; choose one of {list(choices)}.")
    for name, depth_field in LAYER_BOUNDS.items():
        if name not in values or (name == "max_exit_layer" and values[name] is None):
            continue
        layer, depth = values[name], getattr(config, depth_field)
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):  # NumPy's too
            raise ValueError(f"`{name}` must be an integer, got {layer!r}.")
        if not 1 <= layer <= depth:
            raise ValueError(f"`{name}` must lie in [1, {depth}] (`{depth_field}`), got {layer}.")
    if values.get("max_exit_layer") is not None and values["max_exit_layer"] < values.get("min_exit_layer", 1):
        raise ValueError(
            f"`max_exit_layer` ({values['max_exit_layer']}) must not be below `min_exit_layer` "
            f"({values.get('min_exit_layer', 1)})."
        )
    check_thresholds(values, by_policy=resolved)
    check_layer_policies(values, config)
    check_batch_rules(values)
    check_draft_batch_size(values.get("draft_max_batch_size"))
    check_draft_vocabulary(values.get("draft_vocabulary"), config.vocab_size)
    check_encoder_parts({part for part in ENCODER_PARTS if values.get(f"{part}_exit_threshold") is not None}, config)


def check_thresholds(values: dict[str, Any], by_policy: bool = True) -> None:
    """Each threshold knob in `values`: a finite number or one per row, within its score's range (the encoder's
    similarity; with `by_policy`, the decoder's and the drafts' policy's)."""
    for name, bounds in THRESHOLD_RANGES.items():
        threshold = values.get(name)
        if threshold is None:
            continue
        per_row = threshold.tolist() if hasattr(threshold, "tolist") else threshold  # a 1-D tensor: one per row
        per_row = per_row if isinstance(per_row, (list, tuple)) and per_row else [per_row]
        if any(isinstance(value, bool) or not isinstance(value, numbers.Real) for value in per_row):
            raise ValueError(
                f"`{name}` must be a number, one number per row (a list or 1-D tensor), or None, got {threshold!r}."
            )
        if not all(math.isfinite(value) for value in per_row):
            raise ValueError(f"`{name}` must be finite, got {threshold}.")
        if bounds is None and not by_policy:
            continue
        policy = threshold_policy(name, values)
        bounds = bounds or POLICY_RANGES.get(policy)
        if bounds is not None and not all(bounds[0] <= value <= bounds[1] for value in per_row):
            raise ValueError(
                f"`{name}` is a {policy} score's threshold and must lie in {list(bounds)}, got {threshold}."
            )
        if policy in LAYER_POLICIES:
            check_layer_count(name, threshold, values.get("exit_threshold_schedule", "constant"), policy)


def check_layer_count(name: str, threshold: Any, schedule: str = "constant", policy: str = "patience") -> None:
    """The threshold knob `name` of a policy in `LAYER_POLICIES`: one layer count of at least 1 for the whole batch,
    with the constant schedule (a count has nothing to decay)."""
    count = threshold.tolist() if hasattr(threshold, "tolist") else threshold  # a 0-d tensor or NumPy number
    if isinstance(count, bool) or not isinstance(count, numbers.Real) or not float(count).is_integer() or count < 1:
        raise ValueError(
            f"`{name}` of the {policy} policy is one layer count of at least 1 for the whole batch, got {threshold!r}."
        )
    if schedule != "constant":
        raise ValueError(f"`exit_threshold_schedule` {schedule!r} needs a threshold to decay; {policy} has none.")


def threshold_policy(name: str, values: dict[str, Any]) -> str:
    """The policy whose score a threshold knob compares with: the encoder's similarity, the decoder's `exit_policy`,
    the drafts' `draft_exit_policy` (by default the decoder's)."""
    if name == "draft_exit_threshold":
        return values.get("draft_exit_policy") or values.get("exit_policy", "similarity")
    return values.get("exit_policy", "similarity") if name == "exit_threshold" else "similarity"


def check_layer_policies(values: dict[str, Any], config: Any) -> None:
    """A layer count that no asked exit point reaches would never exit, silently: patience's count of exit points in
    a row that agree, above the points asked between `min_exit_layer` and `max_exit_layer`; a fixed layer above the
    deepest asked point. (None asked at all is the no-exit setting of any policy.)"""
    low, high = values.get("min_exit_layer", 1), values.get("max_exit_layer") or config.decoder_layers
    asked = [point for point in config.exit_points if low <= point <= high]
    for policy, threshold in (("exit_policy", "exit_threshold"), ("draft_exit_policy", "draft_exit_threshold")):
        count = values.get(threshold)
        count = count.tolist() if hasattr(count, "tolist") else count  # a 0-d tensor or NumPy number: the number
        drafting_policy = values.get(policy) or values.get("exit_policy")  # the drafts default to the exits' policy
        if not asked or not isinstance(count, numbers.Real) or drafting_policy not in LAYER_POLICIES:
            continue
        if drafting_policy == "patience" and len(asked) < count:
            raise ValueError(
                f"`{threshold}={count}` with the patience policy waits for {count} exit points in a row to agree; this "
                f"decoder asks {len(asked)} (within `min_exit_layer` / `max_exit_layer`), so it would never exit."
            )
        if drafting_policy == "fixed_layer" and max(asked) < count:
            raise ValueError(
                f"`{threshold}={count}` with the fixed_layer policy exits after layer {count}; this decoder asks its "
                f"exits up to layer {max(asked)} (`exit_points` within `min_exit_layer` / `max_exit_layer`), so it "
                "would never exit."
            )


def check_batch_rules(values: dict[str, Any]) -> None:
    """The decoder's batch-level rules: a fraction in (0, 1], and tokens from the batch's layer only for kept rows."""
    fraction = values.get("batch_stop_fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
        raise ValueError(f"`batch_stop_fraction` must be a number in (0, 1], got {fraction!r}.")
    if values.get("exit_token_layer") == "batch" and values.get("row_exit") == "compact":
        raise ValueError(
            '`exit_token_layer="batch"` needs the rows that are ready to keep running to the layer where the batch '
            'stops: use `row_exit="keep"` or "auto", not "compact".'
        )


def check_draft_batch_size(size: Any) -> None:
    """`draft_max_batch_size`: a positive integer, or None (speculative mode drafts at any batch size)."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1):
        raise ValueError(f"`draft_max_batch_size` must be a positive integer or None, got {size!r}.")


def check_draft_vocabulary(vocabulary: Any, vocab_size: int) -> None:
    """`draft_vocabulary`: None (drafts score every token), or distinct token ids in [0, `vocab_size`) (a list, a tuple
    or a 1-D tensor)."""
    if vocabulary is None:
        return
    ids = vocabulary.tolist() if hasattr(vocabulary, "tolist") else vocabulary
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"`draft_vocabulary` must be a non-empty list of token ids or None, got {vocabulary!r}.")
    wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if wrong:
        raise ValueError(f"`draft_vocabulary` must hold token ids in [0, {vocab_size}), got {wrong[:5]}.")
    if len(set(ids)) != len(ids):
        raise ValueError("`draft_vocabulary` holds a token id more than once.")


def check_drafts_used(exit_mode: str, given: dict[str, Any]) -> None:
    """Draft knobs `given` to a lossy call (`exit_mode` "exit") would be ignored: a ValueError names them. (Saved as
    defaults, they serve speculative calls.)"""
    drafts = sorted(name for name in DRAFTING_KNOBS if given.get(name) is not None)
    if drafts and exit_mode != "speculative":
        raise ValueError(
            f'{drafts} set speculative mode\'s drafts, but this call decodes with lossy exits (`exit_mode="exit"`): '
            'add `exit_mode="speculative"`, or drop them.'
        )


def check_encoder_knobs_used(given: dict[str, Any], encoder_ran: bool) -> None:
    """Encoder exits `given` to a call whose encoder already ran (`encoder_outputs` passed in) would change nothing: a
    ValueError names them. (Saved as defaults, they serve calls that run the encoder.)"""
    controllers = given.get("exit_controller")
    parts = set(controllers) & set(ENCODER_PARTS) if isinstance(controllers, dict) else set()
    named = [f"{part}_exit_threshold" for part in ENCODER_PARTS if given.get(f"{part}_exit_threshold") is not None]
    named += [f'exit_controller["{part}"]' for part in ENCODER_PARTS if part in parts]
    if named and encoder_ran:
        raise ValueError(
            f"{named} set the encoder's exits, but `encoder_outputs` were passed in: the encoder already ran. Give "
            "them to the call that runs the encoder, or drop them."
        )


def threshold_knob(part: str) -> str:
    return f"`{part}_exit_threshold`"


def check_encoder_parts(parts: set[str], config: Any, knob: Callable[[str], str] = threshold_knob) -> None:
    """Per-stream exits need the decomposed encoder; the joint exit needs the joint one. `knob(part)` names how a
    part's exit was given (its threshold knob, or an `exit_controller` entry)."""
    if config.decompose_encoder_modalities and "encoder" in parts:
        raise ValueError(
            "This model's encoder runs image and text as separate streams (`decompose_encoder_modalities=True`): "
            f"use {knob('encoder_image')} / {knob('encoder_text')} instead of {knob('encoder')}."
        )
    streams = sorted({"encoder_image", "encoder_text"} & parts)
    if not config.decompose_encoder_modalities and streams:
        raise ValueError(
            f"Exits for {streams} need an encoder that runs image and text as separate streams "
            f"(`decompose_encoder_modalities=True`); this one is joint: use {knob('encoder')}."
        )


def resolve_knobs(config: Any, generation_config: Any = None, **given: Any) -> dict[str, Any]:
    """Every knob's value: given here, else the generation config's, else the model config's, else the default.

    Raises ValueError on an unknown (e.g. misspelt) knob or a bad value.
    """
    unknown = sorted(set(given) - set(EXIT_KNOBS))
    if unknown:
        raise ValueError(f"Unknown early-exit knob(s) {unknown}; the knobs are {list(EXIT_KNOBS)}.")
    for source, where in ((generation_config, "generation config"), (config, "model config")):
        check_no_misspelt_knob(source, where)
    saved = saved_knobs(config, generation_config)
    for name, default in EXIT_KNOBS.items():
        if name not in given and generation_config is not None and hasattr(generation_config, name):
            warn_if_shadowed(name, getattr(config, name, default), saved[name])
    values = saved | given
    check_knobs(values, config)
    return values


def saved_knobs(config: Any, generation_config: Any = None) -> dict[str, Any]:
    """Every knob as a call without knobs starts from: the generation config's, else the model config's, else the
    default; unchecked (`resolve_knobs` checks)."""
    return {
        name: getattr(generation_config, name)
        if generation_config is not None and hasattr(generation_config, name)
        else getattr(config, name, default)
        for name, default in EXIT_KNOBS.items()
    }


def warn_if_shadowed(name: str, in_config: Any, in_generation_config: Any) -> None:
    """A knob set in the model config (`from_pretrained(..., knob=value)`) that the generation config's value
    outranks would change nothing: said once."""
    if in_config is not None and in_config != EXIT_KNOBS[name] and in_config != in_generation_config:
        logger.warning_once(
            f"`{name}={in_config!r}` in the model config is outranked by the generation config's "
            f"`{in_generation_config!r}`: pass it to `generate`, or set `model.generation_config.{name}`."
        )


def check_no_misspelt_knob(source: Any, where: str) -> None:
    """A saved entry named almost like a knob (`exit_treshold`) would be ignored: a ValueError naming both. Only the
    entries that `source`'s class does not define by itself are compared."""
    check_not_misspelt(getattr(source, "__dict__", {}).keys() - own_entries(type(source)), f"The {where} has")


def check_not_misspelt(names: Iterable[str], where: str) -> None:
    """A name almost like a knob's (`exit_treshold`) among `names` is a ValueError: it would be ignored."""
    found = misspelt_knob(frozenset(names).difference(EXIT_KNOBS))
    if found is not None:
        raise ValueError(f"{where} `{found[0]}`, which is no early-exit knob: did you mean `{found[1]}`?")


@functools.lru_cache(maxsize=256)
def misspelt_knob(names: frozenset[str]) -> tuple[str, str] | None:
    """The first of `names` almost like a knob's, and that knob. Remembered: every `generate` call checks its configs'
    names, which rarely change, and `difflib` over them cost about 0.1 ms a call."""
    for name in sorted(names):
        close = difflib.get_close_matches(name, EXIT_KNOBS, n=1, cutoff=0.8)
        if close:
            return name, close[0]
    return None


@functools.cache
def own_entries(kind: type) -> frozenset[str]:
    """The entries a config class sets by itself (none where it cannot be built without arguments)."""
    try:
        return frozenset(vars(kind()))
    except TypeError:
        return frozenset()


def drafts_with_exit_knobs(given: dict[str, Any]) -> bool:
    """Whether speculative mode drafts with the decoder's exit knobs instead of its draft knobs: when the call `given`
    names the decoder's exit (`exit_policy`, `exit_threshold`) and no draft knob."""
    return bool({"exit_policy", "exit_threshold"} & set(given)) and not set(DRAFT_KNOBS) & set(given)


def shown_knobs(values: dict[str, Any]) -> dict[str, Any]:
    """`values` as a report or a model card shows them, as JSON: a draft vocabulary's ids (thousands) as their count,
    a controller by its repr, thresholds per request (tensors, arrays) as lists."""
    shown = dict(values)
    if values.get("draft_vocabulary") is not None:
        shown["draft_vocabulary"] = f"{len(values['draft_vocabulary'])} token ids"
    controller = values.get("exit_controller")
    if isinstance(controller, dict):
        shown["exit_controller"] = {part: repr(value) for part, value in controller.items()}
    elif controller is not None:
        shown["exit_controller"] = repr(controller)
    for name, value in values.items():
        if name.endswith("_threshold") and hasattr(value, "tolist"):
            shown[name] = value.tolist()
    return shown


def non_default_knobs(values: dict[str, Any]) -> dict[str, Any]:
    """The knobs of `values` that differ from their defaults: what a report or a saved setting needs to name."""
    return {name: value for name, value in values.items() if value != EXIT_KNOBS[name]}


__all__ = [
    "CHOICES",
    "DRAFTING_KNOBS",
    "DRAFT_KNOBS",
    "ENCODER_PARTS",
    "EXIT_KNOBS",
    "EXIT_MODES",
    "EXIT_PARTS",
    "EXIT_TOKEN_LAYERS",
    "ExitMode",
    "ExitTokenLayer",
    "ExitPart",
    "ExitPolicy",
    "KVStrategy",
    "KV_STRATEGIES",
    "LAYER_POLICIES",
    "NO_EXIT",
    "POLICY_NAMES",
    "ROW_EXIT_PLANS",
    "RowExitPlan",
    "SCHEDULE_NAMES",
    "SPECULATIVE_KNOBS",
    "POLICY_RANGES",
    "THRESHOLD_RANGES",
    "ThresholdScheduleName",
    "check_batch_rules",
    "check_draft_batch_size",
    "check_draft_vocabulary",
    "check_drafts_used",
    "check_encoder_knobs_used",
    "check_encoder_parts",
    "check_knobs",
    "check_layer_count",
    "check_not_misspelt",
    "check_thresholds",
    "drafts_with_exit_knobs",
    "encoder_exit_parts",
    "non_default_knobs",
    "resolve_knobs",
    "saved_knobs",
    "shown_knobs",
]
