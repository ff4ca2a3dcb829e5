"""The exit losses of `EarlyExitTrainer`, one pure function per `exit_loss`.

Every function reads a batch at its N target tokens only: `exit_features` maps each exit's decoder layer to its
features [N, d] there (after the shared final LayerNorm), in the order of `config.exit_points`; `head` is the shared
output projection, features [N, d] -> logits [N, V]; `final_logits` [N, V] are the last layer's, `targets` [N] the
label ids. Each returns
`(loss, terms)`: the loss summed over the tokens (the trainer divides by the batch's token count) and each loss term,
unweighted and summed over the tokens, under the name it is logged as. `weights` are the `exit_loss_weights`, one
per term in the order of `terms`: the exits, then the last layer. p^T is a softmax at temperature T; wherever the
last layer's distribution serves as a target it is detached.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Terms = dict[str, torch.Tensor]  # a loss term's log name -> its sum over the tokens, a scalar
Head = Callable[[torch.Tensor], torch.Tensor]  # features [N, d] -> logits [N, V]


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Σ_n CE(logits_n, y_n), smoothed; logits [N, V], targets [N] -> a scalar."""
    return F.cross_entropy(logits.float(), targets, reduction="sum", label_smoothing=label_smoothing)


def distillation_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Σ_n T² · KL(p_teacher^T ‖ p_student^T); logits [N, V] -> a scalar."""
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return temperature**2 * (teacher.exp() * (teacher - student)).sum()


def weighted_sum(weights: Sequence[float], terms: Terms) -> torch.Tensor:
    """Σ_i w_i · term_i, one weight per term in the order of `terms`."""
    return sum(weight * term for weight, term in zip(weights, terms.values(), strict=True))


def exit_cross_entropy_terms(
    exit_features: dict[int, torch.Tensor], head: Head, targets: torch.Tensor, label_smoothing: float
) -> Terms:
    """Per exit l: `loss_exit_{l}` = Σ_n CE(head(h_l), y)."""
    return {
        f"loss_exit_{layer}": cross_entropy_sum(head(features), targets, label_smoothing)
        for layer, features in exit_features.items()
    }


def exit_distillation_terms(
    exit_features: dict[int, torch.Tensor], head: Head, final_logits: torch.Tensor, temperature: float
) -> Terms:
    """Per exit e: `loss_exit_{e}` = Σ_n T² · KL(p_last^T ‖ p_e^T), the last layer's logits detached."""
    return {
        f"loss_exit_{layer}": distillation_sum(head(features), final_logits.detach(), temperature)
        for layer, features in exit_features.items()
    }


def final_layer_loss(
    final_logits: torch.Tensor, targets: torch.Tensor, weights: Sequence[float], label_smoothing: float
) -> tuple[torch.Tensor, Terms]:
    """Plain fine-tuning ("none"), the baseline: L = w · CE(head(h_last), y)."""
    terms = {"loss_final": cross_entropy_sum(final_logits, targets, label_smoothing)}
    return weighted_sum(weights, terms), terms


def layerwise_loss(
    exit_features: dict[int, torch.Tensor],
    head: Head,
    final_logits: torch.Tensor,
    targets: torch.Tensor,
    weights: Sequence[float],
    label_smoothing: float,
) -> tuple[torch.Tensor, Terms]:
    """MuE ("layerwise"): L = Σ_l w_l · CE(head(h_l), y), l over the exits and the last layer."""
    terms = exit_cross_entropy_terms(exit_features, head, targets, label_smoothing)
    terms["loss_final"] = cross_entropy_sum(final_logits, targets, label_smoothing)
    return weighted_sum(weights, terms), terms


def deep_supervision_loss(
    layerwise: tuple[torch.Tensor, Terms], weights: Sequence[float]
) -> tuple[torch.Tensor, Terms]:
    """DEED ("deep_supervision"): L = Σ_l w_l · CE(head(adapter_l(h_l)), y) / Σ_l w_l, l over the exits and the last
    layer: `layerwise_loss`'s (loss, terms), averaged with the weights. The model applies its adaptation modules
    before handing out the exit features, so h_l there is already adapter_l(h_l)."""
    loss, terms = layerwise
    return loss / sum(weights), terms


def distillation_loss(
    exit_features: dict[int, torch.Tensor],
    head: Head,
    final_logits: torch.Tensor,
    weights: Sequence[float],
    temperature: float,
) -> tuple[torch.Tensor, Terms]:
    """BLIPEE without labels ("distill"): L = Σ_e w_e · T² · KL(p_last^T ‖ p_e^T), e over the exits."""
    terms = exit_distillation_terms(exit_features, head, final_logits, temperature)
    return weighted_sum(weights, terms), terms


def adversarial_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """Per exit e, the generator's loss Σ_n BCE(D_e(f_e), real): how well the exit's features pass for the last
    layer's. fake_logits [E, N], D_e's logits on exit e's features -> [E]."""
    fooled = torch.ones_like(fake_logits)
    return F.binary_cross_entropy_with_logits(fake_logits, fooled, reduction="none").sum(dim=-1)


def adversarial_loss(
    exit_features: dict[int, torch.Tensor],
    head: Head,
    final_logits: torch.Tensor,
    targets: torch.Tensor | None,
    fake_logits: torch.Tensor,
    weights: Sequence[float],
    adversarial_weight: float,
    label_smoothing: float,
    temperature: float,
) -> tuple[torch.Tensor, Terms]:
    """BLIPEE ("adversarial"): L = Σ_e w_e · task_e + a · Σ_e Σ_n BCE(D_e(f_e), real), e over the exits, where task_e
    is CE(head(h_e), y) with `targets`, else T² · KL(p_last^T ‖ p_e^T); a is `adversarial_weight`. fake_logits [E, N]
    are the discriminators' logits on the exits' features, computed with the discriminators held constant. Adds the
    terms `loss_adv_{e}`, outside the weighted sum."""
    if targets is not None:
        terms = exit_cross_entropy_terms(exit_features, head, targets, label_smoothing)
    else:
        terms = exit_distillation_terms(exit_features, head, final_logits, temperature)
    loss = weighted_sum(weights, terms)
    generator = adversarial_generator_loss(fake_logits)  # [E]
    terms |= {f"loss_adv_{layer}": term for layer, term in zip(exit_features, generator, strict=True)}
    return loss + adversarial_weight * generator.sum(), terms


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """The discriminators' loss L_D = Σ_e [mean_n BCE(D_e(f_last), real) + mean_n BCE(D_e(f_e), fake)]; real_logits
    [E, N] are D_e's logits on the last layer's features, fake_logits [E, N] on exit e's -> a scalar."""
    real = F.binary_cross_entropy_with_logits(real_logits, torch.ones_like(real_logits), reduction="none")
    fake = F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits), reduction="none")
    return (real.mean(dim=-1) + fake.mean(dim=-1)).sum()


__all__ = [
    "adversarial_generator_loss",
    "adversarial_loss",
    "cross_entropy_sum",
    "deep_supervision_loss",
    "discriminator_loss",
    "distillation_loss",
    "distillation_sum",
    "final_layer_loss",
    "layerwise_loss",
]
