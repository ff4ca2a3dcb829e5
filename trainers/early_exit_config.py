"""Training arguments of `EarlyExitTrainer`: the Seq2Seq arguments plus the exit loss and its knobs."""

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from transformers import Seq2SeqTrainingArguments

from ..modeling.exit_knobs import shown_knobs

ExitLoss = Literal["layerwise", "deep_supervision", "distill", "adversarial", "none"]
Weighting = Literal["uniform", "increasing"]
EXIT_LOSSES: tuple[str, ...] = get_args(ExitLoss)
WEIGHTINGS: tuple[str, ...] = get_args(Weighting)
# The losses that train without labels: they distil the last layer's distribution instead.
LABEL_FREE_LOSSES: tuple[ExitLoss, ...] = ("distill", "adversarial")


@dataclass
class EarlyExitTrainingArguments(Seq2SeqTrainingArguments):
    r"""
    [`~transformers.Seq2SeqTrainingArguments`] plus how the exits are trained. Label smoothing is the stock
    `label_smoothing_factor`; it applies to every cross-entropy term.

    exit_loss:
        - "layerwise" (MuE): the task cross-entropy of every exit and of the last layer, summed with the weights.
        - "deep_supervision" (DEED): the same terms through DEED's adaptation modules (`exit_adapter_dim` in the
          config), averaged with the weights.
        - "distill" (BLIPEE without labels): temperature-scaled KL from the last layer's (detached) distribution to
          each exit's, summed with the weights; needs no labels.
        - "adversarial" (BLIPEE): per exit transformer layer (`exit_transformer_layers` in the config), the task term
          (cross-entropy with labels, KL to the last layer without) plus `adversarial_weight` times the generator's
          loss against a feature discriminator, which learns in alternation with its own optimizer.
        - "none": the last layer's cross-entropy alone (plain fine-tuning, the baseline).
    exit_loss_weights: "uniform" (1 each), "increasing" (layer / decoder_layers) or a comma-separated list, one
        weight per loss term: each exit of `config.exit_points`, then the last layer for "layerwise" /
        "deep_supervision"; for "none", the last layer's only.
    freeze_backbone: train the exit heads only (adapters or exit transformer layers); the backbone, its final
        LayerNorm and output projection stay bit-identical.
    distill_temperature: temperature of the KL terms (scaled by its square, as in Hinton et al.).
    adversarial_weight: weight of each exit's generator loss in "adversarial".
    discriminator_hidden_size: hidden width of each exit's feature discriminator (an MLP with one hidden layer).
    discriminator_learning_rate: AdamW learning rate of the discriminators (constant; they follow gradient
        accumulation).
    encoder_exit_sampling: the fraction of training rows whose encoder (each stream of a decomposed one, drawn
        independently) stops after a layer drawn uniformly from 1..L-1, so that the decoder learns to answer from
        the shallower states encoder exits hand it at inference. MuE trains no encoder exit (it relies on a
        pre-trained encoder saturating); a model trained from scratch needs this for encoder exits to keep quality.
    """

    exit_loss: ExitLoss = field(default="layerwise", metadata={"help": "The loss that trains the exits."})
    # A string, not a `Weighting`: it may also be a list of weights.
    exit_loss_weights: str = field(
        default="uniform", metadata={"help": f"One of {list(WEIGHTINGS)} or one comma-separated weight per loss term."}
    )
    freeze_backbone: bool = field(default=False, metadata={"help": "Train the exit heads only."})
    distill_temperature: float = field(default=1.0, metadata={"help": "Temperature of the KL terms."})
    adversarial_weight: float = field(default=0.1, metadata={"help": "Weight of the generators' adversarial loss."})
    discriminator_hidden_size: int = field(default=256, metadata={"help": "Hidden width of each discriminator."})
    discriminator_learning_rate: float = field(default=1e-4, metadata={"help": "Learning rate of the discriminators."})
    encoder_exit_sampling: float = field(
        default=0.0, metadata={"help": "Fraction of training rows whose encoder stops after a random layer."}
    )

    def __post_init__(self):
        if self.exit_loss not in EXIT_LOSSES:
            raise ValueError(f"Unknown `exit_loss` {self.exit_loss!r}; choose one of {list(EXIT_LOSSES)}.")
        if isinstance(self.exit_loss_weights, (list, tuple)):
            self.exit_loss_weights = ",".join(str(weight) for weight in self.exit_loss_weights)
        if self.exit_loss_weights not in WEIGHTINGS:
            self.explicit_weights()  # raises on a malformed list
        # Written so that NaN fails each test (it compares False with everything); inf would train to NaN weights.
        if not 0 < self.distill_temperature < math.inf:
            raise ValueError(f"`distill_temperature` must be a positive number, got {self.distill_temperature}.")
        if not 0 <= self.adversarial_weight < math.inf:
            raise ValueError(f"`adversarial_weight` must be a number >= 0, got {self.adversarial_weight}.")
        if self.discriminator_hidden_size < 1:
            raise ValueError(f"`discriminator_hidden_size` must be positive, got {self.discriminator_hidden_size}.")
        if not 0 < self.discriminator_learning_rate < math.inf:
            raise ValueError(
                f"`discriminator_learning_rate` must be a positive number, got {self.discriminator_learning_rate}."
            )
        if not 0 <= self.encoder_exit_sampling <= 1:
            raise ValueError(f"`encoder_exit_sampling` must lie in [0, 1], got {self.encoder_exit_sampling}.")
        super().__post_init__()

    def to_dict(self) -> dict:
        """As `Seq2SeqTrainingArguments.to_dict`, JSON throughout (what logging integrations write): the evaluation's
        generation config shows a controller by its repr and thresholds per request as lists."""
        values = super().to_dict()
        if isinstance(values.get("generation_config"), dict):
            values["generation_config"] = shown_knobs(values["generation_config"])
        return values

    def __str__(self) -> str:
        # The stock text prints the evaluation's `GenerationConfig` as JSON, which fails on a controller object.
        fields = "".join(f"{name}={value},\n" for name, value in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{fields})"

    __repr__ = __str__

    def explicit_weights(self) -> list[float] | None:
        """The weights given as a list, or None for "uniform" / "increasing"."""
        if self.exit_loss_weights in WEIGHTINGS:
            return None
        try:
            weights = [float(weight) for weight in str(self.exit_loss_weights).split(",")]
        except ValueError:
            weights = []
        # Not NaN or inf, and not all zero: deep supervision divides by their sum.
        if not weights or not all(0 <= weight < math.inf for weight in weights) or not sum(weights) > 0:
            raise ValueError(
                f"`exit_loss_weights` must be one of {list(WEIGHTINGS)} or a comma-separated list of non-negative "
                f"numbers, not all zero, got {self.exit_loss_weights!r}."
            )
        return weights


__all__ = ["EXIT_LOSSES", "LABEL_FREE_LOSSES", "WEIGHTINGS", "EarlyExitTrainingArguments", "ExitLoss", "Weighting"]
