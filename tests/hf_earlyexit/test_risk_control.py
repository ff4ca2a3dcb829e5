"""Learn then Test's p-values: exact where they claim to be, valid (a true risk at the level is rejected at most a
δ share of the time), and as tight as the issue's sample sizes say."""

import math
import random

import pytest

from hf_earlyexit.risk_control import (
    binomial_cdf,
    fixed_sequence_test,
    hoeffding_bentkus_p_value,
    p_value,
    samples_needed,
)


@pytest.mark.parametrize(("k", "n", "p"), [(0, 5, 0.3), (3, 10, 0.3), (7, 40, 0.1), (20, 20, 0.5), (-1, 4, 0.2)])
def test_the_binomial_tail_is_the_sum_of_its_terms(k, n, p):
    exact = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, min(k, n) + 1))
    assert binomial_cdf(k, n, p) == pytest.approx(exact, abs=1e-12)


def test_error_free_samples_to_certify_one_percent_at_delta_0_1():
    assert samples_needed(0.0, 0.01, 0.1, "binary") == 230  # the binomial tail: (0.99)^n <= 0.1
    hoeffding = next(n for n in range(1000, 20000, 10) if math.exp(-2 * n * 0.01**2) <= 0.1)
    assert 11000 < hoeffding < 12000  # what Hoeffding's p-value, exp(-2 n (α - R̂)²), needed
    assert samples_needed(0.01, 0.02, 0.1, "binary") < samples_needed(0.01, 0.02, 0.1, "bounded")
    assert samples_needed(0.02, 0.02, 0.1, "binary") is None  # an observed risk at the level never certifies


@pytest.mark.parametrize("loss", ["binary", "bounded"])
def test_the_samples_needed_are_the_fewest_that_certify_though_more_may_not(loss):
    """The error count is whole (ceil of risk × n), so the p-value falls with n in a sawtooth."""
    from hf_earlyexit.risk_control import certifies

    for risk, level in ((0.005, 0.02), (0.01, 0.05), (0.03, 0.05)):
        needed = samples_needed(risk, level, 0.1, loss)
        assert needed == next(n for n in range(1, needed + 1) if certifies(loss, risk, n, level, 0.1))
    assert samples_needed(0.005, 0.02, 0.1, "binary") == 194  # a bisection over n said 265
    assert not certifies("binary", 0.01, 101, 0.05, 0.1)  # above the 77 needed, a sample size that does not


@pytest.mark.parametrize("loss", ["binary", "bounded"])
def test_a_true_risk_at_the_level_is_certified_at_most_delta_of_the_time(loss):
    rng, level, delta, n = random.Random(0), 0.05, 0.1, 200
    trials = 1000
    certified = sum(
        p_value([float(rng.random() < level) for _ in range(n)], level, loss) <= delta for _ in range(trials)
    )
    assert certified / trials <= delta  # valid; and not vacuous:
    assert p_value([0.0] * n, level, loss) <= delta and p_value([0.0] * 10, level, loss) > delta


def test_hoeffding_bentkus_is_within_e_of_the_binomial_tail_on_binary_losses():
    for errors in (0, 2, 5):
        binary = p_value([1.0] * errors + [0.0] * (300 - errors), 0.03, "binary")
        bounded = hoeffding_bentkus_p_value(errors / 300, 300, 0.03)
        assert binary * (1 - 1e-9) <= bounded <= math.e * binary * (1 + 1e-9)


def test_the_fixed_sequence_stops_at_the_first_setting_that_fails():
    ordered = [[0.0] * 300, [0.0] * 299 + [1.0], [1.0] * 30 + [0.0] * 270, [0.0] * 300]
    certified = fixed_sequence_test(ordered, risk_level=0.02, delta=0.1, loss="binary")
    assert len(certified) == 2 and all(value <= 0.1 for value in certified)  # the last one is never tested


@pytest.mark.parametrize(
    ("losses", "level", "loss", "message"),
    [
        ([0.5], 0.1, "binary", "0 or 1"),
        ([1.5], 0.1, "bounded", r"\[0, 1\]"),
        ([0.0], 0.0, "binary", "must lie in"),
        ([], 0.1, "binary", "at least one"),
        ([0.0], 0.1, "hinge", "Unknown loss kind"),
    ],
)
def test_bad_losses_and_levels_are_refused(losses, level, loss, message):
    with pytest.raises(ValueError, match=message):
        p_value(losses, level, loss)
