"""Early exit in `generate()`: the knobs, the settings they resolve to, and the GenerationMixin override.

`generate(exit_threshold=0.9, ...)` takes the knobs of `EXIT_KNOBS`. Each one is looked up in the call's kwargs,
then in the generation config (where calibration writes its choice), then in the model config (the model's own
defaults), and all of them become one `EarlyExitSettings`. That object travels to `forward` as the
`exit_settings` model kwarg on every step, carries the controllers to the encoder and decoder, and records the exit
layers, which `generate` returns as `exit_layers` / `encoder_exit_layers` with `return_dict_in_generate=True`.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedConfig
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput

from .early_exit_cache import KV_STRATEGIES, EarlyExitCache
from .exit_controllers import POLICY_NAMES, SCHEDULES, ExitController, SimilarityExit, make_controller

# Knob -> default. All but `exit_controller` (an object) are JSON scalars kept in the config / generation config.
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
    "encoder_min_exit_layer": 1,
}
# Parts a controller can be given for, through `exit_controller={part: controller}`.
ENCODER_PARTS = ("encoder", "encoder_image", "encoder_text")
EXIT_PARTS = ("decoder", *ENCODER_PARTS)


@dataclass
class ExitRecord:
    """What exited where during one `generate` (or forward) call.

    decoder_steps: per decoder forward, the decoder layers run for each row's newest token, [rows].
    encoder: encoder layers run per row for (image, text), [batch, 2].
    """

    decoder_steps: list[torch.Tensor] = field(default_factory=list)
    encoder: torch.Tensor | None = None


@dataclass
class EarlyExitSettings:
    """The resolved exit plan of one call: a controller per part (None: that part runs in full), the KV strategy
    for skipped decoder layers, the first decoder and encoder layers allowed to exit, and the decoding length the
    threshold schedules decay over."""

    decoder: ExitController | None = None
    encoder: ExitController | None = None
    encoder_image: ExitController | None = None
    encoder_text: ExitController | None = None
    kv_strategy: str = "propagate"
    min_exit_layer: int = 1
    encoder_min_exit_layer: int = 1
    max_steps: int = 1
    record: ExitRecord = field(default_factory=ExitRecord)

    @classmethod
    def from_knobs(cls, config: PreTrainedConfig, max_steps: int = 1, **knobs) -> "EarlyExitSettings":
        """Settings from knobs, falling back on the config's defaults; a bad or unknown knob is a ValueError."""
        unknown = sorted(set(knobs) - set(EXIT_KNOBS))
        if unknown:
            raise ValueError(f"Unknown early-exit knob(s) {unknown}; the knobs are {list(EXIT_KNOBS)}.")
        value = {name: knobs.get(name, getattr(config, name, default)) for name, default in EXIT_KNOBS.items()}
        check_scalar_knobs(value, config)

        controllers = {}
        custom = value["exit_controller"]
        if isinstance(custom, dict):
            wrong = sorted(set(custom) - set(EXIT_PARTS))
            if wrong:
                raise ValueError(f"`exit_controller` has unknown part(s) {wrong}; parts are {list(EXIT_PARTS)}.")
            controllers.update(custom)
        elif custom is not None:
            controllers["decoder"] = custom
        if value["exit_threshold"] is not None and "decoder" not in controllers:
            controllers["decoder"] = make_controller(
                value["exit_policy"], value["exit_threshold"], value["exit_threshold_schedule"]
            )
        for part in ENCODER_PARTS:
            threshold = value[f"{part}_exit_threshold"]
            if threshold is not None and part not in controllers:
                controllers[part] = SimilarityExit(threshold)
        for part, controller in controllers.items():
            if not callable(controller):
                raise ValueError(f"`exit_controller` for {part!r} must be callable, got {type(controller).__name__}.")
        check_encoder_parts(set(controllers), config)
        return cls(
            **controllers,
            kv_strategy=value["kv_strategy"],
            min_exit_layer=value["min_exit_layer"],
            encoder_min_exit_layer=value["encoder_min_exit_layer"],
            max_steps=max_steps,
        )

    @property
    def exits(self) -> bool:
        """Whether any part has a controller, i.e. may exit early."""
        return any(getattr(self, part) is not None for part in EXIT_PARTS)

    def start(self) -> None:
        """Begin a new generation: an empty record, and controllers that forget earlier calls."""
        self.record = ExitRecord()
        for part in EXIT_PARTS:
            controller = getattr(self, part)
            if isinstance(controller, ExitController):
                controller.reset()


def check_scalar_knobs(value: dict[str, Any], config: PreTrainedConfig) -> None:
    """Name, type and range checks of the JSON knobs: the config's defaults and every `generate` call."""
    for name, choices in (
        ("exit_policy", POLICY_NAMES),
        ("exit_threshold_schedule", list(SCHEDULES)),
        ("kv_strategy", list(KV_STRATEGIES)),
    ):
        if value[name] not in choices:
            raise ValueError(f"Unknown `{name}` {value[name]!r}; choose one of {choices}.")
    for name, part in (("min_exit_layer", "decoder"), ("encoder_min_exit_layer", "encoder")):
        layer, depth = value[name], getattr(config, f"{part}_layers")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"`{name}` must be an integer, got {layer!r}.")
        if not 1 <= layer <= depth:
            raise ValueError(f"`{name}` must lie in [1, {depth}] (the {part}'s depth), got {layer}.")
    for name in ("exit_threshold", *(f"{part}_exit_threshold" for part in ENCODER_PARTS)):
        threshold = value[name]
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise ValueError(f"`{name}` must be a number or None, got {threshold!r}.")
    for part in ENCODER_PARTS:
        threshold = value[f"{part}_exit_threshold"]
        if threshold is not None and not -1.0 <= threshold <= 1.0:
            raise ValueError(
                f"`{part}_exit_threshold` is a cosine similarity and must lie in [-1, 1], got {threshold}."
            )
    check_encoder_parts({part for part in ENCODER_PARTS if value[f"{part}_exit_threshold"] is not None}, config)


def check_encoder_parts(parts: set[str], config: PreTrainedConfig) -> None:
    """Per-stream exits need the decomposed encoder; the joint exit needs the joint one."""
    if config.decompose_encoder_modalities and "encoder" in parts:
        raise ValueError(
            "This model's encoder runs image and text as separate streams (`decompose_encoder_modalities=True`): "
            "use `encoder_image_exit_threshold` / `encoder_text_exit_threshold` instead of `encoder_exit_threshold`."
        )
    streams = sorted({"encoder_image", "encoder_text"} & parts)
    if not config.decompose_encoder_modalities and streams:
        raise ValueError(
            f"Exits for {streams} need an encoder that runs image and text as separate streams "
            "(`decompose_encoder_modalities=True`); this one is joint: use `encoder_exit_threshold`."
        )


def new_cache(config: PreTrainedConfig, settings: EarlyExitSettings | None) -> EncoderDecoderCache:
    """The decoder cache for a call: an `EarlyExitCache` with the call's KV strategy, and the cross-attention cache
    (layers added as they are first written; no config, whose deep copy costs more than a decoding step here)."""
    strategy = settings.kv_strategy if settings is not None else EXIT_KNOBS["kv_strategy"]
    return EncoderDecoderCache(EarlyExitCache(config, strategy), DynamicCache())


@dataclass
class EarlyExitGenerateOutput(GenerateEncoderDecoderOutput):
    """`generate` output (greedy / sampling) with the layers each token used.

    exit_layers: [rows, new_tokens], decoder layers run for each generated token.
    encoder_exit_layers: [rows, 2], encoder layers run for (image, text); both equal for a joint encoder.
    """

    exit_layers: torch.LongTensor | None = None
    encoder_exit_layers: torch.LongTensor | None = None


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
        knobs = {name: kwargs.pop(name) for name in EXIT_KNOBS if name in kwargs}
        source = generation_config if generation_config is not None else self.generation_config
        defaults = {name: getattr(source, name) for name in EXIT_KNOBS if hasattr(source, name)}
        settings = kwargs.pop("exit_settings", None)
        if settings is not None and knobs:
            raise ValueError(f"Pass either `exit_settings` or the knobs {sorted(knobs)}, not both.")
        if settings is None:
            max_steps = kwargs.get("max_new_tokens") or source.max_new_tokens or source.max_length - 1
            settings = EarlyExitSettings.from_knobs(self.config, max_steps=max_steps, **{**defaults, **knobs})
        settings.start()
        if settings.exits and kwargs.get("use_cache") is False:
            raise ValueError("Early exit in `generate` needs `use_cache=True` (skipped layers live in the cache).")
        # A config's `use_cache=False` is a training setting (the Trainer writes it); exits need the cache.
        if settings.exits:
            kwargs["use_cache"] = True

        output = super().generate(inputs, generation_config, exit_settings=settings, **kwargs)
        if not isinstance(output, (GenerateEncoderDecoderOutput, GenerateBeamEncoderDecoderOutput)):
            return output
        exit_layers = generated_exit_layers(settings.record, output)
        encoder = settings.record.encoder  # None when `encoder_outputs` were passed in
        encoder_exit_layers = (
            None if encoder is None else encoder.repeat_interleave(output.sequences.shape[0] // encoder.shape[0], 0)
        )
        output_class = (
            EarlyExitBeamGenerateOutput
            if isinstance(output, GenerateBeamEncoderDecoderOutput)
            else EarlyExitGenerateOutput
        )
        return output_class(**output, exit_layers=exit_layers, encoder_exit_layers=encoder_exit_layers)

    def _prepare_cache_for_generation(
        self, generation_config: GenerationConfig, model_kwargs: dict, generation_mode, batch_size, max_cache_length
    ):
        settings = model_kwargs.get("exit_settings")
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation not in (None, "dynamic"):
                raise ValueError(
                    f"`cache_implementation={generation_config.cache_implementation!r}` is not supported: this model "
                    "decodes with its own dynamic EarlyExitCache, which keeps every layer aligned when tokens exit "
                    "early (and, with `kv_strategy='recompute'`, fills skipped layers later)."
                )
            model_kwargs["past_key_values"] = new_cache(self.config, settings)
            return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )


def generated_exit_layers(record: ExitRecord, output: GenerateEncoderDecoderOutput) -> torch.LongTensor:
    """Decoder layers per returned token, [rows, new_tokens]: the recorded per-step layers, followed through the
    beams that produced each token (`beam_indices`) in beam search."""
    steps = torch.stack(record.decoder_steps, dim=0)  # [steps, running rows]: one decoder forward per new token
    beam_indices = getattr(output, "beam_indices", None)
    if beam_indices is None:
        return steps.T.contiguous()
    beam_indices = beam_indices.long()
    taken = steps.gather(1, beam_indices.clamp(min=0).T.to(steps.device)).T
    return taken.masked_fill(beam_indices.to(steps.device) < 0, 0)


__all__ = [
    "EarlyExitSettings",
    "ExitRecord",
    "EarlyExitGenerationMixin",
    "EarlyExitGenerateOutput",
    "EarlyExitBeamGenerateOutput",
    "EXIT_KNOBS",
]
