"""Configuration of OFA with early exits (hf-earlyexit).

The architecture fields keep the names of the official OFA Hugging Face port (`OFAConfig`), so a
`config.json` of an official checkpoint converts field by field. The defaults are OFA-base; the
`from_preset` class method builds the published sizes.
"""

from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN

from .exit_knobs import EXIT_KNOBS, check_knobs, check_not_misspelt, own_entries

# Bottleneck blocks in ResNet stages 1..3 (OFA drops stage 4 and reads stage 3's 1024 channels).
RESNET_LAYERS = {"resnet50": (3, 4, 6), "resnet101": (3, 4, 23), "resnet152": (3, 8, 36)}
# A light stem for small models (two strided convolutions, stride 16 like the ResNets); not an OFA stem.
PATCH_STEM = "patch"
IMAGE_STEMS = (*RESNET_LAYERS, PATCH_STEM)

# Validation tables: each field's rule, checked by `validate_architecture` with a message that names the field.
POSITIVE_FIELDS = (
    "vocab_size",
    "max_position_embeddings",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "image_bucket_size",
    "code_image_size",
)
RATE_FIELDS = (
    "encoder_layerdrop",
    "decoder_layerdrop",
    "encoder_drop_path_rate",
    "decoder_drop_path_rate",
    "resnet_drop_path_rate",
    "dropout",
    "attention_dropout",
    "activation_dropout",
)
# Field -> why only its default is supported.
FIXED_FIELDS = {
    "encoder_normalize_before": (
        True,
        "`encoder_normalize_before=False` (post-LN) is not supported: OFA layers are pre-LN.",
    ),
    "decoder_normalize_before": (
        True,
        "`decoder_normalize_before=False` (post-LN) is not supported: OFA layers are pre-LN.",
    ),
    "entangle_position_embedding": (
        False,
        "`entangle_position_embedding=True` is not supported: OFA keeps positions in the biases.",
    ),
}

PRESETS = {
    "tiny": dict(
        d_model=256,
        encoder_layers=4,
        decoder_layers=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        resnet_type="resnet50",
    ),
    "medium": dict(
        d_model=512,
        encoder_layers=4,
        decoder_layers=4,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        resnet_type="resnet101",
    ),
    "base": dict(
        d_model=768,
        encoder_layers=6,
        decoder_layers=6,
        encoder_ffn_dim=3072,
        decoder_ffn_dim=3072,
        encoder_attention_heads=12,
        decoder_attention_heads=12,
        resnet_type="resnet101",
    ),
    "large": dict(
        d_model=1024,
        encoder_layers=12,
        decoder_layers=12,
        encoder_ffn_dim=4096,
        decoder_ffn_dim=4096,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        resnet_type="resnet152",
    ),
    "huge": dict(
        d_model=1280,
        encoder_layers=24,
        decoder_layers=12,
        encoder_ffn_dim=5120,
        decoder_ffn_dim=5120,
        encoder_attention_heads=16,
        decoder_attention_heads=16,
        resnet_type="resnet152",
    ),
}


def value_errors(cls: type) -> type:
    """`@strict` refuses a field of the wrong type with its own exception type: make it the ValueError, naming the
    field, that every bad input here gets."""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            raise ValueError(f"Config field `{name}`: {error.__cause__}") from None

    cls.__setattr__ = __setattr__
    return cls


@value_errors
@strict
class OFAEarlyExitConfig(PreTrainedConfig):
    r"""
    Configuration of [`EarlyExitOFAForConditionalGeneration`].

    Architecture (names and meaning as in the official OFA port):
        vocab_size: tokens in the shared embedding / output projection (BART BPE 50265 + 8192 image codes + 1000 bins).
        max_position_embeddings: text positions; the absolute table has 2 extra (unused) rows, as in OFA.
        d_model: hidden width of every layer.
        encoder_layers / decoder_layers: number of Transformer layers.
        encoder_ffn_dim / decoder_ffn_dim: inner width of the feed-forward blocks.
        encoder_attention_heads / decoder_attention_heads: attention heads (d_model must divide evenly).
        encoder_layerdrop / decoder_layerdrop: probability of skipping a whole layer in training.
        encoder_normalize_before / decoder_normalize_before: pre-LN layers (the only kind OFA checkpoints use).
        encoder_drop_path_rate / decoder_drop_path_rate: stochastic depth of the last layer, linear from 0 at layer 0.
        resnet_drop_path_rate: stochastic depth of the ResNet stem's last block.
        activation_function: FFN activation (OFA uses exact-erf "gelu").
        dropout: after the embedding LayerNorm, attention and fc2.
        attention_dropout: on attention probabilities.
        activation_dropout: after the FFN activation.
        init_std: std of the normal init of linear and embedding weights.
        scale_embedding: multiply embeddings by sqrt(d_model).
        normformer: NormFormer extras: mid-LayerNorms after attention, FFN LayerNorm and per-head `c_attn` scale.
        layernorm_embedding / patch_layernorm_embedding / code_layernorm_embedding: LayerNorm on text, image-patch
            and image-code embeddings (the code one exists for checkpoint compatibility; image generation is not
            implemented).
        resnet_type: image stem, "resnet50" | "resnet101" | "resnet152" (OFA: stages 1-3, 1024 channels, stride 16),
            or "patch", a light two-convolution stem for small models (256 channels, stride 16).
        token_bucket_size: buckets of the 1D log-bucketed text relative position bias.
        image_bucket_size: patches per side of the 2D image position grid (max image side = 16 * this).
        add_type_embedding: add a text (0) / image (1) type embedding in the encoder.
        attn_scale_factor: attention and position logits are scaled by (attn_scale_factor * head_dim) ** -0.5.
        code_image_size: image-code grid of OFA's image generation (kept for checkpoint compatibility).
        entangle_position_embedding: add absolute positions to the token embeddings (not used by OFA checkpoints;
            only False is supported).
        tie_word_embeddings: one tensor for encoder embedding, decoder embedding and output projection.
        decompose_encoder_modalities: MuE's modality-decomposed encoder: image and text streams run separately
            through the shared layers (no cross-modal attention) and are concatenated before the final LayerNorm.
        decomposed_image_relative_bias: with a decomposed encoder, add the image relative bias to the image stream.
            False reproduces the official MuE code, whose image stream uses the absolute bias only.

    Early-exit defaults (every one can be overridden per `generate` call, or in the generation config):
        exit_threshold: decoder exit threshold; None = no decoder exits (the full model).
        exit_policy: "similarity" (MuE: cosine of a layer's output and input), "confidence" (max probability of
            the exit head), "margin" (CALM: its top-1 minus top-2 probability), "patience" (the exit head's argmax
            unchanged for `exit_threshold` layers) or "fixed_layer" (every token exits after layer `exit_threshold`:
            a budget, and speculative mode's cheapest draft, since nothing is scored).
        exit_threshold_schedule: "constant", "mue_decay" (the paper's), "mue_official" (the official code's) or
            "calm_decay": how the decoder threshold moves over the decoding steps.
        encoder_exit_threshold: cosine-similarity exit of the joint encoder; None = full depth.
        encoder_image_exit_threshold / encoder_text_exit_threshold: the same per stream of a decomposed encoder.
        kv_strategy: what skipped decoder layers get in the cache: "propagate", "copy" or "recompute".
        min_exit_layer: the first decoder layer (1-based) a token may exit after.
        max_exit_layer: the last decoder layer (1-based) a token may exit after; a token not ready there runs every
            layer, and the controller is not asked after it (None: any layer). Where tokens exit either early or not
            at all, asking only up to here saves the asks that never fire (an exit head and a decision per layer).
        encoder_min_exit_layer: the first encoder layer (1-based) the joint encoder or a stream may exit after; no
            exit test runs below it (calibration sets it to the shallowest exit it saw, so no test is wasted).
        row_exit: what a row that is ready to stop does while other rows of its batch go on: "keep" (it stays in
            the batch and runs the layers the batch runs anyway; its output still comes from its exit), "compact"
            (it leaves the batch and the deeper layers run on the other rows only) or "auto" (compact only where the
            layer costs measured on the device predict it saves time: the encoder and prefill, rarely a decoding
            step, which reads every weight once whatever its rows).
        exit_token_layer: where a decoder row that is ready before its batch stops takes its token from: "own" (its
            exit layer, as at batch 1) or "batch" (the layer where the batch stops, deeper at no extra time: CALM's
            rule; needs a plan that keeps rows).
        batch_stop_fraction: the decoder's batch stops once at least this fraction of its rows is ready, the others
            stopping with them (1.0: only when every row is ready; lower trades quality for time).
        exit_mode: "exit" (each token comes from its exit layer: lossy, the fastest) or "speculative" (lossless:
            the exits draft `num_assistant_tokens` tokens, then one pass runs only the layers the drafts skipped and
            keeps the longest prefix the full model agrees with; the output is the full model's).
        draft_exit_policy / draft_exit_threshold: the decoder's exits while drafting in speculative mode, where the
            fastest drafts come from lower thresholds than lossy exits keep quality with (`hf-earlyexit calibrate
            --exit-mode speculative` picks them); None = `exit_policy` / `exit_threshold`.
        draft_max_batch_size: the most decoder rows a speculative call drafts for; a call with more decodes with the
            full model, which gives the same output: a step costs about its deepest row, so past some batch size the
            drafts no longer save time (`calibrate --exit-mode speculative --draft-batch-sizes` measures where).
            None = draft at any batch size.
        draft_vocabulary: the token ids a draft may propose in speculative mode (FR-Spec): its exit head scores
            these only, which at OFA's vocabulary of 59457 is most of a shallow draft's time; the verification
            scores every token, so the output stays the full model's, and a token outside the list comes from the
            full model alone. None = every token.

    Exit heads (trained modules that map a decoder layer's output to the input of the shared final LayerNorm and
    output projection; with neither field set, every layer uses the shared head directly, as MuE does):
        exit_adapter_dim: DEED's adaptation modules: a residual bottleneck (LayerNorm, d_model -> this -> d_model)
            after every decoder layer but the last, before the shared head. None = no adapters.
        exit_transformer_layers: BLIPEE's exit layers: the 1-based decoder layers (each before the last) that carry
            an exit transformer layer feeding the shared head; tokens may exit only after these layers. An exit
            layer reads the keys and values its host layer already computed, so it adds no cache. None = no exit
            layers.
    """

    # Named choices (`resnet_type`, `exit_policy`, `kv_strategy`, `row_exit`, ...) are typed `str` and checked in
    # `__post_init__`: typed `Literal`, `@strict` would refuse a bad value with its own error instead of the
    # ValueError naming the field that every bad input here gets. Their `Literal` types live in `exit_knobs`.
    model_type = "ofa_early_exit"
    # Outputs the Trainer leaves out of evaluation's predictions: the exits' hidden states would be gathered for
    # every sample.
    keys_to_ignore_at_inference = ["past_key_values", "exit_hidden_states"]
    attribute_map = {
        "num_attention_heads": "encoder_attention_heads",
        "hidden_size": "d_model",
        "num_hidden_layers": "decoder_layers",
    }

    vocab_size: int = 59457
    max_position_embeddings: int = 1024
    d_model: int = 768
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_ffn_dim: int = 3072
    decoder_ffn_dim: int = 3072
    encoder_attention_heads: int = 12
    decoder_attention_heads: int = 12
    encoder_layerdrop: float = 0.0
    decoder_layerdrop: float = 0.0
    encoder_normalize_before: bool = True
    decoder_normalize_before: bool = True
    encoder_drop_path_rate: float = 0.0
    decoder_drop_path_rate: float = 0.0
    resnet_drop_path_rate: float = 0.0
    activation_function: str = "gelu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    init_std: float = 0.02
    scale_embedding: bool = False
    normformer: bool = True
    layernorm_embedding: bool = True
    patch_layernorm_embedding: bool = True
    code_layernorm_embedding: bool = True
    resnet_type: str = "resnet101"
    token_bucket_size: int = 256
    image_bucket_size: int = 42
    add_type_embedding: bool = True
    attn_scale_factor: float = 2.0
    code_image_size: int = 128
    entangle_position_embedding: bool = False
    tie_word_embeddings: bool = True
    decompose_encoder_modalities: bool = False
    decomposed_image_relative_bias: bool = False
    exit_threshold: float | int | None = None
    exit_policy: str = "similarity"
    exit_threshold_schedule: str = "constant"
    encoder_exit_threshold: float | int | None = None
    encoder_image_exit_threshold: float | int | None = None
    encoder_text_exit_threshold: float | int | None = None
    kv_strategy: str = "propagate"
    min_exit_layer: int = 1
    max_exit_layer: int | None = None
    encoder_min_exit_layer: int = 1
    row_exit: str = "auto"
    exit_token_layer: str = "own"
    batch_stop_fraction: float | int = 1.0
    exit_mode: str = "exit"
    draft_exit_policy: str | None = None
    draft_exit_threshold: float | int | None = None
    draft_max_batch_size: int | None = None
    draft_vocabulary: list[int] | None = None
    exit_adapter_dim: int | None = None
    exit_transformer_layers: list[int] | None = None

    use_cache: bool = True
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 0
    forced_eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs):
        # Check here too: `@strict` wraps validator errors in its own (non-ValueError) exception type.
        self.check()
        super().__post_init__(**kwargs)

    def check(self) -> None:
        """Every field and exit knob, a ValueError naming the first that is wrong. The model checks its config again:
        `from_pretrained(..., field=value)` sets its overrides after the config was built."""
        self.validate_architecture()
        check_knobs({name: getattr(self, name, default) for name, default in EXIT_KNOBS.items()}, self, resolved=False)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "OFAEarlyExitConfig":
        """Transformers' `from_dict` (which `from_pretrained` calls with its keyword arguments), refusing an argument
        named almost like an exit knob: Transformers would drop it, or hand it to the model as an unknown argument."""
        check_not_misspelt(kwargs.keys() - own_entries(cls), "`from_pretrained` got")
        if "exit_controller" in kwargs:  # Transformers would hand it to the model as an unknown argument
            raise ValueError(
                "`exit_controller` is an object, which a config cannot save: pass it to `generate`, or set "
                "`model.generation_config.exit_controller` for this process."
            )
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded  # a tuple under `return_unused_kwargs`
        # Their names: the model carries the config's values for them into its generation config, whose saved knobs
        # would otherwise outrank them.
        config.given_exit_knobs = [name for name in EXIT_KNOBS if name in kwargs]
        return loaded

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop("given_exit_knobs", None)  # what one `from_pretrained` call was given, not part of the model
        return output

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "OFAEarlyExitConfig":
        """The published OFA sizes: "tiny", "medium", "base", "large", "huge" (any field can be overridden)."""
        if name not in PRESETS:
            raise ValueError(f"Unknown OFA preset {name!r}; choose one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def exit_points(self) -> list[int]:
        """The 1-based decoder layers a token may exit after (the last layer is the full model, not an exit)."""
        if self.exit_transformer_layers is not None:
            return list(self.exit_transformer_layers)
        return list(range(1, self.decoder_layers))

    @property
    def image_feature_dim(self) -> int:
        """Channels of the image stem's output, the input width of `image_proj`."""
        return 256 if self.resnet_type == PATCH_STEM else 1024

    def validate_architecture(self):
        """Part of `@strict` validation: the fields' own ranges (the tables above), the rules that tie fields together,
        and the exit heads; every message names the offending field."""
        self.check_ranges()
        for side in ("encoder", "decoder"):
            heads = getattr(self, f"{side}_attention_heads")
            if self.d_model % heads:
                raise ValueError(f"`d_model` ({self.d_model}) must be divisible by `{side}_attention_heads` ({heads}).")
        if self.resnet_type not in IMAGE_STEMS:
            raise ValueError(f"Unknown `resnet_type` {self.resnet_type!r}; choose one of {list(IMAGE_STEMS)}.")
        if self.activation_function not in ACT2FN:
            raise ValueError(f"Unknown `activation_function` {self.activation_function!r}.")
        if not 2 <= self.token_bucket_size < 2 * (self.max_position_embeddings - 1):
            raise ValueError(
                f"`token_bucket_size` must lie in [2, 2 * (max_position_embeddings - 1)), got {self.token_bucket_size}."
            )
        self.check_exit_heads()

    def check_ranges(self):
        """Each field of the tables above within its range."""
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {getattr(self, name)}.")
        for name in RATE_FIELDS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"`{name}` must lie in [0, 1], got {getattr(self, name)}.")
        for name, (supported, message) in FIXED_FIELDS.items():
            if getattr(self, name) != supported:
                raise ValueError(message)
        for name in ("attn_scale_factor", "init_std"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}.")

    def check_exit_heads(self):
        """DEED's adapters or BLIPEE's exit layers (not both), on layers before the last."""
        if self.exit_adapter_dim is not None and self.exit_adapter_dim < 1:
            raise ValueError(f"`exit_adapter_dim` must be a positive integer or None, got {self.exit_adapter_dim}.")
        layers = self.exit_transformer_layers
        if layers is None:
            return
        if self.exit_adapter_dim is not None:
            raise ValueError("Set `exit_adapter_dim` (DEED) or `exit_transformer_layers` (BLIPEE), not both.")
        increasing = list(layers) == sorted(set(layers))
        if not layers or not increasing or not 1 <= layers[0] <= layers[-1] < self.decoder_layers:
            raise ValueError(
                "`exit_transformer_layers` must be increasing 1-based decoder layers before the last "
                f"(1..{self.decoder_layers - 1}), got {layers}."
            )


__all__ = ["OFAEarlyExitConfig"]

OFAEarlyExitConfig.register_for_auto_class()
