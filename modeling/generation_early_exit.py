"""Early exit in `generate()`: the settings the knobs resolve to, and the GenerationMixin override.

`generate(exit_threshold=0.9, ...)` takes the knobs of `exit_knobs.EXIT_KNOBS`, resolved there (call, then generation
config, then model config) into one `EarlyExitSettings`: the plan of the call. It travels to `forward` as the
`exit_settings` model kwarg on every step and carries the controllers to the encoder and decoder; it is not changed
during the call. The layer each row exited after comes back in the model's outputs (`exit_layers`,
`encoder_exit_layers`: the layer its output comes from; under `row_exit="keep"` a row may run deeper with the batch);
`generate` gathers them step by step as the stock decoding loops hand it each step's outputs, and returns them as
`exit_layers` / `encoder_exit_layers` with `return_dict_in_generate=True`.
"""

import contextlib
import copy
import dataclasses
import numbers
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    MaxLengthCriteria,
    MaxTimeCriteria,
    PreTrainedConfig,
    StoppingCriteriaList,
)
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput
from transformers.utils import ModelOutput, logging

from .early_exit_cache import EarlyExitCache
from .exit_controllers import ExitController, SimilarityExit, make_controller, per_row
from .exit_knobs import (
    ENCODER_PARTS,
    EXIT_KNOBS,
    EXIT_PARTS,
    SPECULATIVE_KNOBS,
    THRESHOLD_RANGES,
    ExitMode,
    ExitTokenLayer,
    KVStrategy,
    RowExitPlan,
    check_drafts_used,
    check_encoder_knobs_used,
    check_encoder_parts,
    drafts_with_exit_knobs,
    resolve_knobs,
)
from .row_exits import AutoPlan, CompactPlan, KeepPlan, LayerCosts, RowExits
from .speculative import DEFAULT_DRAFT_TOKENS, speculative_generate

logger = logging.get_logger(__name__)


@dataclass
class EarlyExitSettings:
    """The resolved exit plan of one call: a controller per part (None: that part runs in full), the KV strategy
    for skipped decoder layers, the first decoder and encoder layers allowed to exit (and the last decoder one,
    None: any), the decoding length the threshold schedules decay over (new tokens, after a decoder prompt of
    `prompt_length` tokens), and what ready rows do at batch > 1 (`row_exit`, and the decoder's batch-level rules
    `exit_token_layer` and `batch_stop_fraction`), and the `exit_mode`: lossy exits, or exits that draft for the full
    model (`speculative`, up to `draft_max_batch_size` decoder rows, proposing tokens of the `draft_vocabulary` only:
    None, any)."""

    decoder: ExitController | None = None
    encoder: ExitController | None = None
    encoder_image: ExitController | None = None
    encoder_text: ExitController | None = None
    kv_strategy: KVStrategy = "propagate"
    min_exit_layer: int = 1
    max_exit_layer: int | None = None
    encoder_min_exit_layer: int = 1
    max_steps: int = 1
    prompt_length: int = 1
    row_exit: RowExitPlan = "auto"
    exit_token_layer: ExitTokenLayer = "own"
    batch_stop_fraction: float = 1.0
    exit_mode: ExitMode = "exit"
    draft_max_batch_size: int | None = None
    draft_vocabulary: tuple[int, ...] | None = None

    @classmethod
    def from_knobs(
        cls,
        config: PreTrainedConfig,
        generation_config: Any = None,
        max_steps: int = 1,
        requests: int | None = None,
        rows_per_request: int = 1,
        prompt_length: int = 1,
        **knobs,
    ) -> "EarlyExitSettings":
        """Settings from knobs (`exit_knobs.resolve_knobs`: the call's, then the generation config's, then the model
        config's); a bad or unknown knob is a ValueError. A threshold given per request (a list or a 1-D tensor) must
        have `requests` values; the decoder's are repeated for each request's `rows_per_request` decoder rows."""
        value = thresholds_per_row(resolve_knobs(config, generation_config, **knobs), requests, rows_per_request)
        controllers = {}
        custom = value["exit_controller"]
        if isinstance(custom, dict):
            wrong = sorted(set(custom) - set(EXIT_PARTS))
            if wrong:
                raise ValueError(f"`exit_controller` has unknown part(s) {wrong}; parts are {list(EXIT_PARTS)}.")
            controllers.update(custom)
        elif custom is not None:
            controllers["decoder"] = custom
        decoder = decoder_controller(value, knobs)
        if decoder is not None and "decoder" not in controllers:
            controllers["decoder"] = decoder
        for part in ENCODER_PARTS:
            threshold = value[f"{part}_exit_threshold"]
            if threshold is not None and part not in controllers:
                controllers[part] = SimilarityExit(threshold)
        for part, controller in controllers.items():
            if not callable(controller):
                raise ValueError(f"`exit_controller` for {part!r} must be callable, got {type(controller).__name__}.")
        # The threshold knobs were checked with the others: a part that does not fit came from `exit_controller`.
        check_encoder_parts(set(controllers), config, knob=lambda part: f'`exit_controller={{"{part}": ...}}`')
        settings = cls(
            **controllers,
            kv_strategy=value["kv_strategy"],
            min_exit_layer=value["min_exit_layer"],
            max_exit_layer=value["max_exit_layer"],
            encoder_min_exit_layer=value["encoder_min_exit_layer"],
            max_steps=max_steps,
            prompt_length=prompt_length,
            row_exit=value["row_exit"],
            exit_token_layer=value["exit_token_layer"],
            batch_stop_fraction=value["batch_stop_fraction"],
            exit_mode=value["exit_mode"],
            draft_max_batch_size=value["draft_max_batch_size"],
        )
        if settings.exit_mode != "speculative":
            return settings
        vocabulary = value["draft_vocabulary"]
        ids = vocabulary.tolist() if hasattr(vocabulary, "tolist") else vocabulary  # a tensor or an array
        return settings.drafting(knobs, None if ids is None else tuple(ids))

    def drafting(self, given: dict[str, Any], vocabulary: tuple[int, ...] | None = None) -> "EarlyExitSettings":
        """The settings of speculative mode, whose output is the full model's (`SPECULATIVE_KNOBS`): the encoder runs
        in full (its exits would change what the decoder reads), the cache keeps exact K/V (`recompute`: the
        verification runs only the layers the drafts skipped and keeps them), and a drafting row leaves the layers
        after its exit (`compact`: kept running, it would first run the layers its earlier drafts skipped, one token
        at a time), and drafts propose tokens of the draft `vocabulary` only. Saved defaults that say otherwise are set
        aside; knobs `given` in this call with another value than their default are a ValueError, since they would be
        ignored."""
        if self.decoder is None:
            raise ValueError(
                '`exit_mode="speculative"` drafts with the decoder\'s exits: set `draft_exit_threshold`, '
                "`exit_threshold` or an `exit_controller` for the decoder."
            )
        conflicts = [
            f"{name}={given[name]!r}"
            for name, value in SPECULATIVE_KNOBS.items()
            if given.get(name, value) not in (value, EXIT_KNOBS[name])
        ]
        custom = given.get("exit_controller")
        conflicts += (
            sorted(f"exit_controller[{part!r}]" for part in set(custom) - {"decoder"})
            if isinstance(custom, dict)
            else []
        )
        if conflicts:
            raise ValueError(
                '`exit_mode="speculative"` sets these knobs itself, so that the output is the full model\'s (the '
                'encoder runs in full; drafts keep exact keys and values, `kv_strategy="recompute"` and '
                '`row_exit="compact"`, and stop where their own exit, `draft_exit_*`, says; the verification runs the '
                f"rest): drop {conflicts}."
            )
        fixed = {name: value for name, value in SPECULATIVE_KNOBS.items() if not name.endswith("_exit_threshold")}
        parts = dict.fromkeys(ENCODER_PARTS)  # the encoder runs in full
        return dataclasses.replace(self, **parts, **fixed, draft_vocabulary=vocabulary)

    def for_rows(self, rows: int) -> "EarlyExitSettings":
        """The settings a call of `rows` decoder rows decodes with: in speculative mode past `draft_max_batch_size`,
        where drafts stop paying, the full decoder's (no decoder exit, and the default KV strategy: a `recompute`
        cache costs 1–2% of a step even where no token exits)."""
        bound = self.draft_max_batch_size
        if self.exit_mode != "speculative" or bound is None or rows <= bound:
            return self
        return dataclasses.replace(self, decoder=None, exit_mode="exit", kv_strategy=EXIT_KNOBS["kv_strategy"])

    @property
    def exits(self) -> bool:
        """Whether any part has a controller, i.e. may exit early."""
        return any(getattr(self, part) is not None for part in EXIT_PARTS)

    def asked_layers(self, exit_points: Iterable[int], depth: int) -> tuple[int, ...]:
        """The decoder layers (1-based, of the `depth` a step runs) after which its controller is asked: the
        `exit_points` from `min_exit_layer` to `max_exit_layer` (None: `depth`); none without a decoder controller."""
        if self.decoder is None:
            return ()
        last = self.max_exit_layer or depth
        return tuple(layer for layer in exit_points if self.min_exit_layer <= layer <= last)

    def row_exits(
        self,
        part: str,
        batch_size: int,
        depth: int,
        device: torch.device,
        costs: Callable[[], LayerCosts],
        discarded: torch.Tensor | None = None,
    ) -> RowExits:
        """The row-exit mechanism of one layer loop of `part` under this plan. `costs()` measures (once per shape)
        what `row_exit="auto"` decides with, asked only when a row is ready while others go on. The batch-level rules
        are the decoder's; rows whose output `generate` throws away (`discarded` [batch]: finished) do not count toward
        its stop fraction."""
        decoder = part == "decoder"
        plan = self.row_exit
        if plan == "auto" and (batch_size == 1 or (decoder and self.exit_token_layer == "batch")):
            plan = "keep"  # one row: nothing to compact; the batch's layer: ready rows must run to it
        return RowExits(
            batch_size,
            depth,
            device,
            plan=AutoPlan(costs) if plan == "auto" else KeepPlan() if plan == "keep" else CompactPlan(),
            token_from_batch_layer=decoder and self.exit_token_layer == "batch",
            stop_fraction=self.batch_stop_fraction if decoder else 1.0,
            discarded=discarded,
        )

    def reset_controllers(self) -> None:
        """Controllers that keep state across layers (patience) forget earlier calls. Read by attribute, not by
        `isinstance(..., ExitController)`: a model loaded as remote code has its own copy of that class, and the
        user's controllers come from the package's."""
        for part in EXIT_PARTS:
            reset = getattr(getattr(self, part), "reset", None)
            if callable(reset):
                reset()


# The thresholds of decoder controllers, whose rows are a request's beams and returned sequences.
DECODER_THRESHOLD_KNOBS = ("exit_threshold", "draft_exit_threshold")


def thresholds_per_row(value: dict[str, Any], requests: int | None, rows_per_request: int) -> dict[str, Any]:
    """The resolved knobs `value` with each threshold given per request checked against the call's `requests` and, for
    the decoder (which runs each request's beams and returned sequences as `rows_per_request` rows), repeated."""
    value = dict(value)
    for name in THRESHOLD_RANGES:
        values = value[name] = None if value[name] is None else per_row(value[name])
        if not isinstance(values, torch.Tensor):
            continue
        if requests is not None and values.shape[0] != requests:
            raise ValueError(f"`{name}` has {values.shape[0]} values: give one per request of the batch ({requests}).")
        value[name] = values.repeat_interleave(rows_per_request) if name in DECODER_THRESHOLD_KNOBS else values
    return value


def decoder_controller(value: dict[str, Any], given: dict[str, Any]) -> ExitController | None:
    """The decoder's controller from the resolved knobs `value` (None: no decoder exit). In speculative mode it drafts
    with `draft_exit_policy` / `draft_exit_threshold` where they are set, unless the call `given` names the decoder's
    exit (`exit_policy`, `exit_threshold`) and no draft knob: then it drafts with that. The draft knobs are checked
    in every mode, so a bad saved one fails where it is saved."""
    policy, threshold, schedule = value["exit_policy"], value["exit_threshold"], value["exit_threshold_schedule"]
    draft_policy, draft_threshold = value["draft_exit_policy"] or policy, value["draft_exit_threshold"]
    if draft_threshold is not None:
        try:
            make_controller(draft_policy, draft_threshold, schedule)
        except ValueError as error:
            raise ValueError(f"`draft_exit_threshold`: {error}") from None
    if value["exit_mode"] == "speculative" and not drafts_with_exit_knobs(given):
        policy, threshold = draft_policy, threshold if draft_threshold is None else draft_threshold
    return None if threshold is None else make_controller(policy, threshold, schedule)


# The stateful controller instances (`ExitController.keeps_state`) inside a `generate` call now, by id: `generate` is
# thread-safe, but two concurrent calls sharing one such instance would mix their rows' state.
_CLAIMED: set[int] = set()
_CLAIMED_LOCK = threading.Lock()


@contextlib.contextmanager
def stateful_controllers_claimed(settings: EarlyExitSettings) -> Iterator[None]:
    """Hold `settings`' stateful controllers for one `generate` call; ValueError if another call holds one."""
    controllers = [getattr(settings, part) for part in EXIT_PARTS]
    stateful = {id(c) for c in controllers if getattr(c, "keeps_state", False)}  # any copy of `ExitController`
    with _CLAIMED_LOCK:
        if stateful & _CLAIMED:
            raise ValueError(
                "An `exit_controller` that keeps state across layers (e.g. PatienceExit) is running in another "
                "`generate` call: give each concurrent call its own instance."
            )
        _CLAIMED.update(stateful)
    try:
        yield
    finally:
        with _CLAIMED_LOCK:
            _CLAIMED.difference_update(stateful)


@dataclass
class ExitLayerLog:
    """What one `generate` call gathers from the model's outputs, for its own output.

    decoder_steps: per decoding step, its output's `exit_layers` [rows]. encoder: the encoder output's
    `exit_layers` [batch, 2] when `generate` ran the encoder (None when `encoder_outputs` were passed in).
    stops: per step of greedy and sampling's loop, the rows its stopping criteria ended [rows] (tokens after are
    padding).
    """

    decoder_steps: list[torch.Tensor] = field(default_factory=list)
    encoder: torch.Tensor | None = None
    stops: list[torch.Tensor] = field(default_factory=list)


def pads_ended_rows(criteria: StoppingCriteriaList) -> bool:
    """Whether greedy and sampling's loop pads a row its stopping criteria ended: only with an end-token criterion.
    Without one it feeds the row its own tokens until every row has ended, and keeps them."""
    return any(hasattr(criterion, "eos_token_id") for criterion in criteria)


class RecordedStops(StoppingCriteriaList):
    """A call's stopping criteria that record the rows each step ends, whichever criterion ends them (an end token,
    a stop string, a user's), where the loop pads them from then on: in the `log`, and in the `cache`, whose decoder
    then stops a row fed its last token at the first exit (its token is thrown away) instead of holding the batch in
    deeper layers."""

    def __init__(self, criteria: StoppingCriteriaList, log: ExitLayerLog | None, cache: EarlyExitCache | None):
        super().__init__(criteria)
        self.recording = pads_ended_rows(criteria)
        self.log, self.cache = log, cache
        if cache is not None:
            cache.ended = None  # a cache passed in from an earlier call starts with no row ended

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = super().__call__(input_ids, scores, **kwargs)
        if self.recording and self.log is not None:
            self.log.stops.append(done)
        if self.recording and self.cache is not None:
            self.cache.end_rows(done)
        return done


def new_cache(config: PreTrainedConfig, settings: EarlyExitSettings | None) -> EncoderDecoderCache:
    """The decoder cache for a call: an `EarlyExitCache` with the call's KV strategy, and the cross-attention cache
    (layers added as they are first written; no config, whose deep copy costs more than a decoding step here)."""
    strategy = settings.kv_strategy if settings is not None else EXIT_KNOBS["kv_strategy"]
    return EncoderDecoderCache(EarlyExitCache(config, strategy), DynamicCache())


def with_cross_attention_cache(cache: object) -> object:
    """A decoder cache alone, as BART takes it, as the self-attention cache beside a new cross-attention one; anything
    else as it is."""
    if isinstance(cache, Cache) and not isinstance(cache, EncoderDecoderCache):
        return EncoderDecoderCache(cache, DynamicCache())
    return cache


@dataclass
class EarlyExitGenerateOutput(GenerateEncoderDecoderOutput):
    """`generate` output (greedy / sampling) with the layers each token used.

    exit_layers: [rows, new_tokens], the decoder layer each generated token exited after (speculative mode: the draft's
        layer for an accepted draft, the full depth for the full model's own tokens).
    encoder_exit_layers: [rows, 2], the encoder layer each row exited after (image, text); both equal for a joint
        encoder.
    drafted_tokens / accepted_tokens / speculative_rounds: [rows], speculative mode only: the tokens each row
        drafted, how many of them the full model accepted, and the rounds (draft, then verify) it took; zeros where
        the call had more rows than `draft_max_batch_size` and the full model decoded.
    """

    exit_layers: torch.LongTensor | None = None
    encoder_exit_layers: torch.LongTensor | None = None
    drafted_tokens: torch.LongTensor | None = None
    accepted_tokens: torch.LongTensor | None = None
    speculative_rounds: torch.LongTensor | None = None


@dataclass
class EarlyExitBeamGenerateOutput(GenerateBeamEncoderDecoderOutput):
    """`generate` output (beam search) with the layers each token of the returned beams used; see
    `EarlyExitGenerateOutput`. Positions past a beam's end hold 0."""

    exit_layers: torch.LongTensor | None = None
    encoder_exit_layers: torch.LongTensor | None = None


class EarlyExitGenerationMixin(GenerationMixin):
    """`generate` with early-exit knobs. The stock decoding loops (greedy, sampling, beam search) run unchanged;
    the exit happens inside `forward`, and the cache is an `EarlyExitCache`."""

    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        if kwargs.get("decoder_inputs_embeds") is not None:  # Transformers' loop appends ids to ids
            raise ValueError(
                "`generate` starts the decoder from token ids: give a decoder prompt as `decoder_input_ids`; "
                "`decoder_inputs_embeds` is for `forward`."
            )
        knobs = {name: kwargs.pop(name) for name in EXIT_KNOBS if name in kwargs}
        encoder_outputs = kwargs.get("encoder_outputs")
        check_encoder_knobs_used(knobs, encoder_ran=encoder_outputs is not None)
        if getattr(encoder_outputs, "cross_position_keys", None) is not None:  # an earlier call's, maybe other weights
            kwargs["encoder_outputs"] = dataclasses.replace(encoder_outputs, cross_position_keys=None)
        settings = kwargs.pop("exit_settings", None)
        if settings is not None and knobs:
            raise ValueError(f"Pass either `exit_settings` or the knobs {sorted(knobs)}, not both.")
        source = self.generation_config if generation_config is None else completed(generation_config, self)
        prompt, requests = kwargs.get("decoder_input_ids"), request_count(inputs, kwargs)
        check_decoder_inputs(kwargs, requests)
        prompt_length = 1 if prompt is None else prompt.shape[-1]
        values = within_positions(self.config, source, kwargs, prompt_length)
        if settings is None:
            max_steps = decoding_steps(source, {**kwargs, **values}, prompt_length)
            # Transformers expands each request into max(num_beams, num_return_sequences) decoder rows.
            expand = max(kwargs.get(name) or getattr(source, name, None) or 1 for name in ROW_EXPANSIONS)
            settings = EarlyExitSettings.from_knobs(
                self.config, source, max_steps, requests, expand, prompt_length, **knobs
            )
        check_drafts_used(settings.exit_mode, knobs)
        check_decoding(settings, source, kwargs)
        if settings.decoder is not None and kwargs.get("use_cache") is False:
            raise ValueError(
                "Decoder exits in `generate` need `use_cache=True` (skipped layers live in the cache): drop "
                "`use_cache=False`, or turn the decoder's exits off (`exit_threshold=None`; they may come from the "
                "model's saved defaults)."
            )
        # A config's `use_cache=False` is a training setting (the Trainer writes it); exits decode with the cache,
        # unless the call itself asks otherwise (encoder exits alone do not need it).
        if settings.exits and kwargs.get("use_cache") is not False:
            values["use_cache"] = True
        if (
            settings.exit_mode == "speculative"
            and kwargs.get("num_assistant_tokens", source.num_assistant_tokens) is None
        ):
            values["num_assistant_tokens"] = DEFAULT_DRAFT_TOKENS  # not Transformers' global default of 20
        generation_config, kwargs = with_generation_values(generation_config, kwargs, values)

        log = ExitLayerLog()
        with stateful_controllers_claimed(settings):
            settings.reset_controllers()
            output = super().generate(inputs, generation_config, exit_settings=settings, exit_layer_log=log, **kwargs)
        if not isinstance(output, (GenerateEncoderDecoderOutput, GenerateBeamEncoderDecoderOutput)):
            return output
        encoder = log.encoder
        encoder_exit_layers = (
            None if encoder is None else encoder.repeat_interleave(output.sequences.shape[0] // encoder.shape[0], 0)
        )
        if isinstance(output, EarlyExitGenerateOutput) and output.exit_layers is not None:  # speculative
            output.encoder_exit_layers = encoder_exit_layers
            return output
        output_class = (
            EarlyExitBeamGenerateOutput
            if isinstance(output, GenerateBeamEncoderDecoderOutput)
            else EarlyExitGenerateOutput
        )
        exit_layers = generated_exit_layers(log.decoder_steps, output, log.stops)
        return output_class(**output, exit_layers=exit_layers, encoder_exit_layers=encoder_exit_layers)

    def adjust_generation_fn(self, *args, **kwargs) -> None:
        # `from_pretrained` loads the saved generation config here; a knob given to that call outranks its saved value.
        super().adjust_generation_fn(*args, **kwargs)
        given = self.config.__dict__.pop("given_exit_knobs", [])
        if given and self.generation_config is not None:
            self.generation_config.update(**{name: getattr(self.config, name) for name in given})

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 *args, **kwargs):  # fmt: skip
        # Transformers hands the assistant's `generate` this call's model kwargs: the exit settings and
        # `exit_layer_log` are this model's, so the assistant decodes with its own (its saved defaults, or none for
        # another model).
        own = {key: value for key, value in model_kwargs.items() if key not in ("exit_settings", "exit_layer_log")}
        return super()._get_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, own, *args, **kwargs
        )

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):  # fmt: skip
        settings = model_kwargs.get("exit_settings")
        speculative = settings is not None and settings.exit_mode == "speculative"
        if speculative:  # with too many rows for drafts to pay, the full model decodes: the output drafts would give
            model_kwargs["exit_settings"] = settings = settings.for_rows(input_ids.shape[0])
            if settings.exit_mode == "speculative":
                return self._speculative_sample(
                    input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
                )
        cache = getattr(model_kwargs.get("past_key_values"), "self_attention_cache", None)
        cache = cache if isinstance(cache, EarlyExitCache) else None
        stopping_criteria = RecordedStops(stopping_criteria, model_kwargs.get("exit_layer_log"), cache)
        output = super()._sample(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
        )
        if cache is not None:  # the loop's record: a later call or `forward` starts with none ended
            cache.ended = None
        if not speculative or not generation_config.return_dict_in_generate:
            return output
        none = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return EarlyExitGenerateOutput(**output, drafted_tokens=none, accepted_tokens=none, speculative_rounds=none)

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, **model_kwargs):  # fmt: skip
        # `generate` hands `inputs_tensor` (the assistant's encoder reruns on it) to a method that names it.
        output = super()._assisted_decoding(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, inputs_tensor,
            **model_kwargs,
        )  # fmt: skip
        if not isinstance(output, GenerateEncoderDecoderOutput):
            return output
        # One verification pass keeps several tokens, each of them the full decoder's (`check_decoding` refuses
        # decoder exits here); assisted decoding runs one row, so none pads.
        new_tokens = output.sequences.shape[1] - input_ids.shape[1]
        layers = torch.full((output.sequences.shape[0], new_tokens), self.config.decoder_layers, dtype=torch.long)
        return EarlyExitGenerateOutput(**output, exit_layers=layers.to(output.sequences.device))

    def _speculative_sample(
        self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs: dict[str, Any]
    ):
        ending_rows = [type(c).__name__ for c in stopping_criteria if not isinstance(c, ENDING_EVERY_ROW)]
        if ending_rows and not pads_ended_rows(stopping_criteria):
            raise ValueError(
                f'`exit_mode="speculative"` with {ending_rows} needs an end token (`eos_token_id`): without one, '
                "Transformers keeps decoding a row such a criterion ended until every row has ended, which rows that "
                "advance on their own cannot follow."
            )
        result = speculative_generate(
            self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs
        )
        if not generation_config.return_dict_in_generate:
            return result.sequences
        return EarlyExitGenerateOutput(
            sequences=result.sequences,
            scores=result.scores,
            logits=result.logits,
            past_key_values=model_kwargs["past_key_values"],
            exit_layers=result.exit_layers,
            drafted_tokens=result.drafted,
            accepted_tokens=result.accepted,
            speculative_rounds=result.rounds,
        )

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]):
        # `exit_layer_log` is `generate`'s own record, never a model input.
        super()._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k != "exit_layer_log"})

    def _prepare_text_encoder_decoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, *args, **kwargs):
        model_kwargs = super()._prepare_text_encoder_decoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, *args, **kwargs
        )
        log = model_kwargs.get("exit_layer_log")
        if log is not None:
            log.encoder = model_kwargs["encoder_outputs"].exit_layers
        return model_kwargs

    def _update_model_kwargs_for_generation(
        self, outputs: ModelOutput, model_kwargs: dict[str, Any], *args, **kwargs
    ) -> dict[str, Any]:
        log = model_kwargs.get("exit_layer_log")
        if log is not None and getattr(outputs, "exit_layers", None) is not None:
            log.decoder_steps.append(outputs.exit_layers)
        return super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict, generation_mode, batch_size, max_cache_length
    ):
        settings = model_kwargs.get("exit_settings")
        implementation = generation_config.cache_implementation
        if model_kwargs.get("past_key_values") is not None:
            model_kwargs["past_key_values"] = with_cross_attention_cache(model_kwargs["past_key_values"])
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            # The full decoder (no decoder exits, no drafts) takes any Transformers cache, a static one included, so
            # that it can decode compiled; exits need the EarlyExitCache.
            full_decoder = settings is None or (settings.decoder is None and settings.exit_mode != "speculative")
            if implementation not in (None, "dynamic") and not full_decoder:
                raise ValueError(
                    f"`cache_implementation={implementation!r}` serves the full decoder only: decoder exits and "
                    "speculative drafts decode with the model's own dynamic EarlyExitCache, which keeps every layer "
                    "aligned when tokens exit early. Drop `cache_implementation`, or the decoder exit knobs."
                )
            if implementation in (None, "dynamic"):
                rows = max(generation_config.num_beams, generation_config.num_return_sequences) * batch_size
                decoding = None if settings is None else settings.for_rows(rows)
                model_kwargs["past_key_values"] = new_cache(self.config, decoding)
                return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )


ROW_EXPANSIONS = ("num_beams", "num_return_sequences")
ENDING_EVERY_ROW = (MaxLengthCriteria, MaxTimeCriteria)  # stopping criteria that end every row at once
DRAFT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def completed(generation_config: GenerationConfig, model: GenerationMixin) -> GenerationConfig:
    """A call's own generation config as Transformers completes it: its unset fields, and the entries it lacks (the
    exit knobs a calibration saved), from the model's generation config. An exit knob the call's config holds is its
    own, None included: None means "no exit" there, not "unset", so `exit_threshold=None` asks for the full decoder."""
    own = {name: getattr(generation_config, name) for name in EXIT_KNOBS if name in vars(generation_config)}
    generation_config = copy.deepcopy(generation_config)
    generation_config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    generation_config.update(**own)
    return generation_config


def decoding_steps(generation_config: GenerationConfig, kwargs: dict[str, Any], prompt_length: int = 1) -> int:
    """The new tokens a call decodes at most: `max_new_tokens`, else `max_length` less the decoder's prompt (its start
    token), else Transformers' default (which it adds to the decoder's input length when no length is set)."""
    given = kwargs.get("max_new_tokens") or generation_config.max_new_tokens
    if given:
        return given
    length = kwargs.get("max_length") or generation_config.max_length
    return length - prompt_length if length else GenerationConfig._get_default_generation_params()["max_length"]


def within_positions(
    config: PreTrainedConfig, generation_config: GenerationConfig, kwargs: dict[str, Any], prompt_length: int
) -> dict[str, Any]:
    """The call's length bound (`max_new_tokens`, else `max_length`) capped, with a warning, where it asks for more
    new tokens than the decoder's positions hold (a pipeline's default of 256 on a small model): the step past them
    would be refused, losing what the call decoded. The newest token is never fed, so a sequence may be one longer
    than the positions."""
    most = config.max_position_embeddings + 1 - prompt_length
    steps = decoding_steps(generation_config, kwargs, prompt_length)
    if steps <= most or most < 1:  # a prompt past the positions is refused by name in `forward`
        return {}
    logger.warning_once(
        f"{steps} new tokens would pass the {config.max_position_embeddings} positions this decoder covers "
        f"(`max_position_embeddings`): decoding stops after {most}."
    )
    if kwargs.get("max_new_tokens") or generation_config.max_new_tokens:
        return {"max_new_tokens": most}
    return {"max_length": config.max_position_embeddings + 1}


def with_generation_values(
    generation_config: GenerationConfig | None, kwargs: dict[str, Any], values: dict[str, Any]
) -> tuple[GenerationConfig | None, dict[str, Any]]:
    """`generate`'s (generation config, kwargs) with `values` set: on a copy of the call's own config when it passed
    one (Transformers warns about generation kwargs beside a config), else as kwargs."""
    if not values:
        return generation_config, kwargs
    if generation_config is None:
        return None, {**kwargs, **values}
    generation_config = copy.deepcopy(generation_config)
    generation_config.update(**values)
    return generation_config, kwargs


def request_count(inputs: torch.Tensor | None, kwargs: dict[str, Any]) -> int | None:
    """The batch size of a `generate` call, from whichever input it was given (None: none yet)."""
    given = [inputs, *(kwargs.get(name) for name in ("input_ids", "inputs_embeds", "pixel_values"))]
    encoder_outputs = kwargs.get("encoder_outputs")
    if encoder_outputs is not None:
        given.append(encoder_outputs.last_hidden_state)
    return next((tensor.shape[0] for tensor in given if tensor is not None), None)


def check_decoder_inputs(kwargs: dict[str, Any], requests: int | None) -> None:
    """A decoder prompt (or its mask) of another batch size than the inputs' is a ValueError naming it; Transformers
    would fail deep in the model, or index past a row."""
    for name in ("decoder_input_ids", "decoder_attention_mask"):
        given = kwargs.get(name)
        if given is not None and requests is not None and given.shape[0] != requests:
            raise ValueError(
                f"`{name}` has {given.shape[0]} rows but the inputs have {requests}: give one row per input row."
            )


ASSISTED = ("assistant_model", "prompt_lookup_num_tokens")


def check_decoding(settings: EarlyExitSettings, generation_config: GenerationConfig, kwargs: dict[str, Any]) -> None:
    """Decoding methods that exits would silently change, or that OFA cannot run (classifier-free guidance), refused
    with a ValueError that names the knob: assisted decoding verifies several tokens in one pass under one exit
    decision per row, so lossy exits change its output; speculative mode is its own assisted decoding, greedy or
    sampling."""
    guidance = kwargs.get("guidance_scale", generation_config.guidance_scale)
    if guidance is not None and guidance != 1:
        raise ValueError(
            f"`guidance_scale={guidance!r}`: classifier-free guidance runs the model without its decoder inputs, "
            "which OFA, an encoder-decoder, cannot do. Drop `guidance_scale`."
        )
    if kwargs.get("assistant_early_exit", generation_config.assistant_early_exit) is not None:
        raise ValueError(
            "`assistant_early_exit` drafts with the first layers of a decoder-only model; this model drafts with its "
            'own exits: use `exit_mode="speculative"` (lossless), and drop `assistant_early_exit`.'
        )
    assisted = sorted(name for name in ASSISTED if kwargs.get(name, getattr(generation_config, name, None)))
    speculative = settings.exit_mode == "speculative"
    if assisted and speculative:
        raise ValueError(f'`exit_mode="speculative"` drafts with the model\'s own exits: drop {assisted}.')
    if assisted and settings.decoder is not None:
        raise ValueError(
            f"{assisted} verify several tokens in one pass, which lossy decoder exits would change: use "
            '`exit_mode="speculative"` (lossless), or no decoder exit.'
        )
    if not speculative:
        return
    if (kwargs.get("num_beams") or generation_config.num_beams or 1) > 1:
        raise ValueError('`exit_mode="speculative"` decodes greedily or by sampling: set `num_beams=1`.')
    check_speculative_cache(kwargs.get("past_key_values"))
    outputs = ("output_attentions", "output_hidden_states")
    asked = [name for name in outputs if kwargs.get(name, getattr(generation_config, name, None))]
    if asked or kwargs.get("synced_gpus"):
        raise ValueError(f'`exit_mode="speculative"` does not support {asked or ["synced_gpus"]}.')
    check_draft_length(
        kwargs.get("num_assistant_tokens", generation_config.num_assistant_tokens),
        kwargs.get("num_assistant_tokens_schedule", generation_config.num_assistant_tokens_schedule),
    )


def check_speculative_cache(cache: Any) -> None:
    """A cache passed to speculative mode (to read it after the call) must be empty, and keep exact keys and values
    (`EarlyExitCache(config, "recompute")`, alone or in an `EncoderDecoderCache`), as the one it makes itself."""
    if cache is None:
        return
    own = getattr(cache, "self_attention_cache", cache)
    if own.get_seq_length() > 0:
        raise ValueError(
            '`exit_mode="speculative"` decodes from an empty cache: pass the whole decoder prefix as '
            "`decoder_input_ids`, without `past_key_values`."
        )
    if not isinstance(own, EarlyExitCache) or own.kv_strategy != "recompute":
        raise ValueError(
            '`exit_mode="speculative"` keeps exact keys and values: pass no cache, or an empty '
            '`EarlyExitCache(config, "recompute")`.'
        )


def check_draft_length(draft_tokens: Any, schedule: Any) -> None:
    """Speculative mode's draft length: a whole number of drafts per round, at least 1, and a schedule that
    Transformers names (None: the defaults)."""
    if draft_tokens is not None and (
        isinstance(draft_tokens, bool) or not isinstance(draft_tokens, numbers.Integral) or draft_tokens < 1
    ):
        raise ValueError(f"`num_assistant_tokens` is the drafts per round, a whole number >= 1; got {draft_tokens!r}.")
    if schedule is not None and schedule not in DRAFT_SCHEDULES:
        raise ValueError(f"`num_assistant_tokens_schedule` must be one of {list(DRAFT_SCHEDULES)}; got {schedule!r}.")


def generated_exit_layers(
    decoder_steps: list[torch.Tensor], output: GenerateEncoderDecoderOutput, stops: list[torch.Tensor] | None = None
) -> torch.LongTensor:
    """Decoder layers per returned token, [rows, new_tokens], 0 past a row's end: each step's layers, followed
    through the beams that produced each token (`beam_indices`) in beam search; in greedy and sampling's loop, which
    pads a row after the step whose stopping check ended it (`stops`, per step [rows]), 0 after that step."""
    steps = torch.stack(decoder_steps, dim=0)  # [steps, running rows]: one decoder forward per new token
    beam_indices = getattr(output, "beam_indices", None)
    if beam_indices is None:
        layers = steps.T.contiguous()
        if not stops:
            return layers
        ended = torch.stack(stops[: layers.shape[1]], dim=1).to(layers.device).long()  # [rows, steps]
        return layers.masked_fill(ended.cumsum(dim=1) - ended > 0, 0)  # ended at an earlier step
    beam_indices = beam_indices.long()
    taken = steps.gather(1, beam_indices.clamp(min=0).T.to(steps.device)).T
    return taken.masked_fill(beam_indices.to(steps.device) < 0, 0)


__all__ = [
    "EarlyExitSettings",
    "EarlyExitGenerationMixin",
    "EarlyExitGenerateOutput",
    "EarlyExitBeamGenerateOutput",
    "ExitLayerLog",
]
