"""Exit controllers: their measures on hand-built states, schedules, patience, the OR-list, and bad input."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_earlyexit.modeling.exit_controllers import (
    CALMSchedule,
    ConfidenceExit,
    ExitController,
    ExitControllerList,
    ExitState,
    FixedLayerExit,
    MuEOfficialSchedule,
    MuEPaperSchedule,
    PatienceExit,
    SimilarityExit,
    checked_decision,
    make_controller,
)


def state(current, previous=None, logits=None, layer=1, step=0, rows=None, mask=None, max_steps=16):
    previous = current if previous is None else previous
    rows = torch.arange(current.shape[0]) if rows is None else rows
    return ExitState(
        part="decoder",
        layer=layer,
        step=step,
        hidden_states=current,
        previous_hidden_states=previous,
        rows=rows,
        num_layers=6,
        max_steps=max_steps,
        attention_mask=mask,
        logits_fn=(lambda: logits) if logits is not None else None,
    )


def test_similarity_is_per_row_cosine_over_real_tokens():
    torch.manual_seed(0)
    previous = torch.randn(3, 4, 8)
    current = previous.clone()
    current[1] = -previous[1]  # row 1 flips: cosine -1
    current[2, 3] = torch.randn(8) * 100  # row 2 differs only at a pad position
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    controller = SimilarityExit(0.99)
    assert controller.score(state(current, previous, mask=mask)).tolist() == pytest.approx([1.0, -1.0, 1.0], abs=1e-6)
    assert controller(state(current, previous, mask=mask)).tolist() == [True, False, True]


def test_similarity_batch_reduction_is_one_decision_like_the_official_code():
    torch.manual_seed(0)
    previous = torch.randn(2, 3, 8)
    current = previous + 0.01 * torch.randn(2, 3, 8)
    current[1] = -previous[1]
    expected = F.cosine_similarity(current.reshape(1, -1), previous.reshape(1, -1)).item()
    scores = SimilarityExit(0.5, reduction="batch").score(state(current, previous))
    assert scores.tolist() == pytest.approx([expected, expected])
    # A row that stopped but runs on with its batch (`row_exit="keep"`) is left out, as if it had left the layers.
    waiting = state(current, previous)
    waiting.waiting = torch.tensor([True, False])
    alone = F.cosine_similarity(current[:1].reshape(1, -1), previous[:1].reshape(1, -1)).item()
    assert SimilarityExit(0.5, reduction="batch").score(waiting).tolist() == pytest.approx([alone, alone])


@pytest.mark.parametrize(
    ("measure", "expected"),
    [
        ("max_probability", [0.7, 0.25]),
        ("margin", [0.5, 0.0]),
        ("entropy", None),
    ],
)
def test_confidence_measures(measure, expected):
    probabilities = torch.tensor([[0.7, 0.2, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]])
    scores = ConfidenceExit(0.5, measure=measure).score(state(torch.zeros(2, 1, 4), logits=probabilities.log()))
    if expected is None:
        entropy = -(probabilities[0] * probabilities[0].log()).sum().item()
        expected = [1 - entropy / math.log(4), 0.0]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)


def test_margin_policy_stops_on_the_top_two_margin():
    """CALM's margin is a policy of its own, so calibration and saved defaults can name it."""
    probabilities = torch.tensor([[0.7, 0.2, 0.05, 0.05], [0.45, 0.4, 0.1, 0.05]])  # margins 0.5 and 0.05
    decision = make_controller("margin", 0.3)(state(torch.zeros(2, 1, 4), logits=probabilities.log()))
    assert decision.tolist() == [True, False]
    assert make_controller("confidence", 0.3)(state(torch.zeros(2, 1, 4), logits=probabilities.log())).tolist() == [
        True,
        True,
    ]


def test_threshold_one_never_exits():
    one_hot = torch.tensor([[0.0, 100.0]])
    assert not ConfidenceExit(1.0)(state(torch.zeros(1, 1, 2), logits=one_hot)).any()
    assert not SimilarityExit(1.0)(state(torch.ones(1, 2, 4))).any()
    # A layer that changes nothing: rounding puts the cosine of equal vectors above 1.0 about half the time.
    same = torch.randn(200, 3, 32, generator=torch.Generator().manual_seed(0))
    for reduction in ("row", "batch"):
        assert not SimilarityExit(1.0, reduction=reduction)(state(same, same.clone())).any()
    assert not SimilarityExit(0.5, schedule="mue_official")(state(same, same.clone(), step=0)).any()


def test_logits_are_computed_once_and_only_when_asked():
    calls = []
    exit_state = state(torch.ones(1, 1, 4))
    exit_state.logits_fn = lambda: calls.append(1) or torch.tensor([[3.0, 0.0]])
    SimilarityExit(0.5)(exit_state)
    assert calls == []
    ExitControllerList([ConfidenceExit(0.5), PatienceExit(1)])(exit_state)
    assert calls == [1]


def test_schedules_follow_their_formulas():
    paper = MuEPaperSchedule(0.9, beta=0.8, tau=2.0)
    assert paper(5, 16) == pytest.approx(0.8 * 0.9 + 0.2 * math.exp(-5 / 32))
    official = MuEOfficialSchedule(0.9)  # the caption example of reference/mue_official.md
    assert [official(s, 16) for s in (0, 5)] == [1.0, 1.0]
    assert official(6, 16) == pytest.approx(0.876, abs=1e-3) and official(16, 16) == pytest.approx(0.847, abs=1e-3)
    calm = CALMSchedule(0.9, tau=4.0)
    assert calm(0, 16) == pytest.approx(0.91) and calm(16, 16) == pytest.approx(0.81 + 0.1 * math.exp(-4))
    assert CALMSchedule(-0.5)(16, 16) == pytest.approx(-0.45 + 0.1 * math.exp(-4))  # a similarity's, lowered too


def test_scheduled_threshold_changes_the_decision_over_steps():
    controller = SimilarityExit(0.9, schedule="mue_official")
    previous = torch.ones(1, 1, 4)
    current = previous + torch.tensor([0.0, 0.0, 0.0, 0.8])  # cosine ~0.96
    assert not controller(state(current, previous, step=0)).any()
    assert controller(state(current, previous, step=10)).all()


@pytest.mark.parametrize("schedule", ["constant", "mue_decay", "mue_official", "calm_decay"])
@pytest.mark.parametrize("threshold", [0.9, [0.95, 0.9, 0.85, 0.8]])
def test_a_step_per_row_decides_each_row_as_its_own_step_would(schedule, threshold):
    """Speculative mode at batch > 1 gives each row its own step; with per-row thresholds, over compacted rows too."""
    controller = SimilarityExit(threshold, schedule=schedule)
    previous = torch.ones(3, 1, 4)
    current = previous + torch.tensor([0.0, 0.0, 0.0, 0.8])  # cosine ~0.96, between the thresholds' steps
    rows, steps = torch.tensor([0, 2, 3]), torch.tensor([0, 6, 15])
    together = controller(state(current, previous, step=steps, rows=rows))
    one_by_one = [
        bool(controller(state(current[i : i + 1], previous[i : i + 1], step=int(steps[i]), rows=rows[i : i + 1])))
        for i in range(3)
    ]
    assert together.tolist() == one_by_one


def test_a_controllers_repr_names_every_option():
    """Calibration and reports tell settings apart by it: two measures or reductions printed alike."""
    texts = {repr(c) for c in (ConfidenceExit(0.5), ConfidenceExit(0.5, measure="margin"), SimilarityExit(0.5),
                               SimilarityExit(0.5, reduction="batch"), SimilarityExit(MuEPaperSchedule(0.5, beta=0.8)),
                               SimilarityExit(MuEPaperSchedule(0.5)))}  # fmt: skip
    assert len(texts) == 6


def test_a_controllers_thresholds_per_row_are_per_decoded_row_and_the_error_says_so():
    controller = SimilarityExit([0.5, 0.9])
    current = torch.ones(4, 1, 4)
    with pytest.raises(
        ValueError, match="one per beam; the threshold knobs.* repeat a request's for them, a controller"
    ):
        controller(state(current))  # two requests of two beams each: four decoded rows


def test_a_new_policy_on_threshold_exit_gets_thresholds_per_request_and_schedules():
    from hf_earlyexit import ThresholdExit
    from tests.helpers import tiny_inputs, tiny_model

    class DepthExit(ThresholdExit):  # readiness: the share of the layers run
        def score(self, state):
            return torch.full((state.rows.shape[0],), state.layer / state.num_layers)

    with pytest.raises(ValueError, match=r"must lie in \[0.0, 1.0\]"):
        DepthExit(1.5)

    class KeptThreshold(DepthExit):  # a subclass's own attribute named like the base's method
        def __init__(self, threshold):
            super().__init__(threshold)
            self.threshold = threshold

    assert KeptThreshold(0.2)(state(torch.ones(1, 1, 4), layer=2)).tolist() == [True]  # 2 / 6 > 0.2
    model = tiny_model(decoder_layers=4)
    out = model.generate(
        **tiny_inputs(batch=2), exit_controller=DepthExit([0.2, 0.6]), max_new_tokens=3, return_dict_in_generate=True
    )
    assert out.exit_layers.tolist() == [[1, 1, 1], [3, 3, 3]]  # strictly above: 1/4 > 0.2, 3/4 > 0.6


def test_patience_counts_unchanged_predictions_per_row_and_restarts_each_token():
    controller = PatienceExit(patience=2)
    a, b = torch.tensor([5.0, 0.0, 0.0]), torch.tensor([0.0, 5.0, 0.0])
    hidden = torch.zeros(2, 1, 3)
    decisions = [
        controller(state(hidden, logits=torch.stack([a, a]), layer=1)),
        controller(state(hidden, logits=torch.stack([a, b]), layer=2)),
        controller(state(hidden[:1], logits=torch.stack([b]), layer=3, rows=torch.tensor([1]))),
        controller(state(hidden, logits=torch.stack([a, a]), layer=1, step=1)),
    ]
    assert [d.tolist() for d in decisions] == [[False, False], [True, False], [True], [False, False]]


def test_patience_restarts_at_each_tokens_first_asked_layer_whatever_it_is():
    """With `min_exit_layer=2` a token's first question comes after layer 2: the streak of the token before must not
    carry over (which would also make keep and compact differ, and follow the wrong beam)."""
    controller = PatienceExit(patience=2)
    a = torch.tensor([[5.0, 0.0, 0.0]])
    hidden = torch.zeros(1, 1, 3)
    decisions = [
        controller(state(hidden, logits=a, layer=2)),
        controller(state(hidden, logits=a, layer=3)),
        controller(state(hidden, logits=a, layer=2, step=1)),
        controller(state(hidden, logits=a, layer=3, step=1)),
    ]
    assert [d.tolist() for d in decisions] == [[False], [True], [False], [True]]


def test_controller_list_stops_when_any_member_does():
    class Never(ExitController):
        def __call__(self, exit_state):
            return torch.zeros(exit_state.rows.shape[0], dtype=torch.bool)

    class OnlyRowZero(ExitController):
        def __call__(self, exit_state):
            return exit_state.rows == 0

    assert ExitControllerList([Never(), OnlyRowZero()])(state(torch.ones(3, 1, 2))).tolist() == [True, False, False]


def test_a_controller_list_holds_plain_callables_too_in_generate():
    """A controller is any callable `ExitState -> BoolTensor`: a list resets and claims only those that keep state."""
    from tests.helpers import tiny_inputs, tiny_model

    def row_zero(exit_state):
        return exit_state.rows == 0

    listed = ExitControllerList([row_zero, PatienceExit(1)])
    assert listed.keeps_state
    with torch.no_grad():
        out = tiny_model().generate(
            **tiny_inputs(), max_new_tokens=3, exit_controller=listed, return_dict_in_generate=True
        )
    assert bool((out.exit_layers[0] == 1).all())


def test_a_fixed_layer_callable_of_the_wrong_shape_is_named():
    exit_state = state(torch.ones(3, 1, 2))
    with pytest.raises(ValueError, match=r"FixedLayerExit.*one per active row \(3,\), got shape \(3, 1\)"):
        FixedLayerExit(lambda s: torch.ones(s.rows.shape[0], 1, dtype=torch.long))(exit_state)


def test_a_user_controller_with_the_wrong_shape_is_named_in_the_error():
    class Broken(ExitController):
        def __call__(self, exit_state):
            return torch.tensor(True)

    exit_state = state(torch.ones(3, 1, 2))
    with pytest.raises(ValueError, match=r"exit_controller.*Broken.*shape \(3,\)"):
        checked_decision(Broken()(exit_state), exit_state, Broken())
    with pytest.raises(ValueError, match="exit_controller"):
        ExitControllerList([Broken()])(exit_state)


def test_a_user_controller_that_returns_scores_is_refused_not_cast():
    """A readiness score cast to bool would stop every row whose score is not exactly 0; 0/1 integers pass."""
    exit_state = state(torch.ones(3, 1, 2))
    with pytest.raises(ValueError, match=r"must return a BoolTensor .* got torch.float32"):
        checked_decision(torch.tensor([0.01, 0.0, 0.9]), exit_state, FixedLayerExit(1))
    assert checked_decision(torch.tensor([1, 0, 1]), exit_state, FixedLayerExit(1)).tolist() == [True, False, True]
    with pytest.raises(ValueError, match=r"got torch.int64 values \[-1, 0, 2\]: an integer decision is 0 or 1"):
        checked_decision(torch.tensor([2, 0, -1]), exit_state, FixedLayerExit(1))  # e.g. a predicted layer count


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: make_controller("similarity", 1.5), "exit_threshold"),
        (lambda: make_controller("confidence", -0.1), "exit_threshold"),
        (lambda: make_controller("loudness", 0.5), "exit_policy"),
        (lambda: make_controller("similarity", 0.5, schedule="sometimes"), "exit_threshold_schedule"),
        (lambda: make_controller("similarity", 0.5, reduction="token"), "reduction"),
        (lambda: make_controller("confidence", 0.5, measure="vibes"), "measure"),
        (lambda: make_controller("patience", 0), "`exit_threshold` of the patience policy"),
        (lambda: make_controller("patience", 1.5), "layer count"),
        (lambda: make_controller("patience", [2, 3]), "one layer count .* for the whole batch"),
        (lambda: make_controller("patience", 2, schedule="mue_official"), "`exit_threshold_schedule`"),
        (lambda: make_controller("fixed_layer", 0), "`exit_threshold` of the fixed_layer policy"),
        (lambda: make_controller("fixed_layer", 1.5), "layer count"),
        (lambda: make_controller("fixed_layer", [1, 2]), "one layer count .* for the whole batch"),
        (lambda: make_controller("fixed_layer", 2, schedule="calm_decay"), "fixed_layer has none"),
    ],
)
def test_bad_knobs_raise_value_errors_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_base_controller_must_be_implemented():
    with pytest.raises(NotImplementedError):
        ExitController()(state(torch.ones(1, 1, 2)))
    with pytest.raises(ValueError, match="No exit head"):
        ConfidenceExit(0.5)(state(torch.ones(1, 1, 2)))
