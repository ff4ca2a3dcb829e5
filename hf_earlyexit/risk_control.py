"""Risk control that certifies: Learn then Test (Angelopoulos et al., 2021) with p-values tight enough for the
calibration sets a user has.

A setting's risk is the expected per-sample loss against the full model, a loss in [0, 1]:
- `"binary"`: 1 where the answer differs from the full model's. The number of differing answers among n samples is
  Binomial(n, R), so the exact p-value of "R > α" is the binomial tail P(Binomial(n, α) <= errors).
- `"bounded"`: any loss in [0, 1] (a caption's relative CIDEr drop). Hoeffding–Bentkus, the bound the LTT paper
  recommends: p = min(exp(-n h(min(R̂, α), α)), e P(Binomial(n, α) <= ⌈n R̂⌉)), h the binary relative entropy.

Hoeffding's p-value, exp(-2 n (α - R̂)²), needs about 11,500 error-free samples to certify α = 1% at δ = 0.1; the
binomial tail needs 230. `fixed_sequence_test` walks settings in an order fixed before the tested samples are seen
(the expected time reduction measured on a separate ordering split) and certifies the prefix whose p-values are
all at most δ: with probability at least 1 - δ, every certified setting has risk at most α.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal

LossKind = Literal["binary", "bounded"]
LOSS_KINDS = ("binary", "bounded")


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (no underflow for the n of a calibration split)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(term - top) for term in terms))


def binary_relative_entropy(a: float, b: float) -> float:
    """h(a, b) = a log(a / b) + (1 - a) log((1 - a) / (1 - b)), with 0 log 0 = 0."""
    first = a * math.log(a / b) if a > 0 else 0.0
    second = (1 - a) * math.log((1 - a) / (1 - b)) if a < 1 else 0.0
    return first + second


def binomial_p_value(errors: int, samples: int, risk_level: float) -> float:
    """p-value of "the risk exceeds `risk_level`" for 0/1 losses: `errors` among `samples`."""
    return binomial_cdf(errors, samples, risk_level)


def hoeffding_bentkus_p_value(mean_loss: float, samples: int, risk_level: float) -> float:
    """p-value of "the risk exceeds `risk_level`" for losses in [0, 1] with empirical mean `mean_loss`."""
    hoeffding = math.exp(-samples * binary_relative_entropy(min(mean_loss, risk_level), risk_level))
    # The sum of the losses, rounded against float noise before the ceiling.
    bentkus = math.e * binomial_cdf(math.ceil(round(samples * mean_loss, 9)), samples, risk_level)
    return min(1.0, hoeffding, bentkus)


def p_value(losses: Sequence[float], risk_level: float, loss: LossKind) -> float:
    """p-value of "the expected loss exceeds `risk_level`" from per-sample `losses` of kind `loss`; ValueError on
    losses outside [0, 1], or not 0/1 for `"binary"`."""
    check_risk(risk_level)
    if loss not in LOSS_KINDS:
        raise ValueError(f"Unknown loss kind {loss!r}; choose one of {list(LOSS_KINDS)}.")
    if not losses:
        raise ValueError("A p-value needs at least one per-sample loss.")
    if loss == "binary":
        if any(value not in (0, 1) for value in losses):
            raise ValueError('"binary" losses must be 0 or 1.')
        return binomial_p_value(int(sum(losses)), len(losses), risk_level)
    if any(not 0 <= value <= 1 for value in losses):
        raise ValueError('"bounded" losses must lie in [0, 1].')
    return hoeffding_bentkus_p_value(sum(losses) / len(losses), len(losses), risk_level)


def check_risk(risk_level: Any, delta: Any = None) -> None:
    """ValueError unless the risk level (and `delta`, when given) is a number in (0, 1)."""
    for name, value in [("risk level", risk_level), *([("delta", delta)] if delta is not None else [])]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ValueError(f"The {name} must lie in (0, 1), got {value!r}.")


def fixed_sequence_test(
    ordered_losses: Sequence[Sequence[float]], risk_level: float, delta: float, loss: LossKind
) -> list[float]:
    """The p-values of the certified prefix of `ordered_losses` (per setting, its per-sample losses, in the order
    fixed in advance): every setting up to, not including, the first whose p-value exceeds `delta`."""
    check_risk(risk_level, delta)
    certified = []
    for losses in ordered_losses:
        value = p_value(losses, risk_level, loss)
        if value > delta:
            break
        certified.append(value)
    return certified


def samples_needed(observed_risk: float, risk_level: float, delta: float, loss: LossKind) -> int | None:
    """How many samples would certify a setting whose empirical risk stays `observed_risk`: the smallest n whose
    p-value at that risk is at most `delta`; None when `observed_risk` is not below `risk_level`, where no n does.
    Both p-values count whole errors, ceil(observed_risk * n) (Bentkus' bound for a bounded loss), so they fall with
    n in a sawtooth, and a larger n may not certify: among the n with k errors, the most, floor(k / observed_risk),
    certify first."""
    check_risk(risk_level, delta)
    if not 0 <= observed_risk < risk_level:
        return None
    if observed_risk > 0:
        errors = 1
        while not certifies(loss, observed_risk, math.floor(round(errors / observed_risk, 9)), risk_level, delta):
            errors += 1
        low, high = math.floor(round((errors - 1) / observed_risk, 9)), math.floor(round(errors / observed_risk, 9))
    else:  # the p-value falls with n: doubling, then bisection
        high = 1
        while not certifies(loss, observed_risk, high, risk_level, delta):
            high *= 2
        low = high // 2
    while high - low > 1:  # `high` certifies, `low` does not (or holds fewer errors)
        middle = (low + high) // 2
        low, high = (low, middle) if certifies(loss, observed_risk, middle, risk_level, delta) else (middle, high)
    return high


def certifies(loss: LossKind, observed_risk: float, samples: int, risk_level: float, delta: float) -> bool:
    """Whether `samples` samples at empirical risk `observed_risk` certify `risk_level` at `delta`."""
    if loss == "binary":
        return binomial_p_value(math.ceil(round(observed_risk * samples, 9)), samples, risk_level) <= delta
    return hoeffding_bentkus_p_value(observed_risk, samples, risk_level) <= delta


__all__ = [
    "LOSS_KINDS",
    "LossKind",
    "binomial_cdf",
    "binomial_p_value",
    "fixed_sequence_test",
    "hoeffding_bentkus_p_value",
    "p_value",
    "samples_needed",
]
