"""Exit controllers: after each layer, which rows may stop here?

A controller is any callable `ExitController.__call__(state: ExitState) -> BoolTensor[rows]` (True = stop after
this layer), in the spirit of `transformers.StoppingCriteria` but asked per layer instead of per token. The model
builds the `ExitState`; controllers never import the model.

Policies:
- `SimilarityExit` (MuE): cosine similarity of a layer's output and input; per row, or over the whole batch as the
  official MuE code does;
- `ConfidenceExit` (DEED, BLIPEE, CALM): confidence of the exit head's distribution (max probability, top-2 margin,
  or 1 - normalised entropy);
- `PatienceExit` (PABEE): the exit head's argmax has not changed for `patience` layers;
- `ExitControllerList`: stop when any of its controllers says stop.

Every measure is "higher = more ready to stop" and a row stops when it is strictly above the threshold, so a
constant threshold of 1.0 (similarity, confidence) never stops anything (a decaying schedule falls below it).
"""

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .exit_knobs import (
    LAYER_POLICIES,
    POLICY_NAMES,
    POLICY_RANGES,
    SCHEDULE_NAMES,
    ExitPart,
    ExitPolicy,
    ThresholdScheduleName,
    check_layer_count,
)


@dataclass
class ExitState:
    """What a controller sees after one layer ran.

    part: "decoder" | "encoder_image" | "encoder_text" | "encoder".
    layer: 1-based count of layers of that part run so far.
    step: decoding step, 0-based: the new tokens decoded before this one (after a decoder prompt; 0 in the encoder).
        An int, one step for the batch; in speculative mode at batch > 1 (more rows than `draft_max_batch_size`
        excepted: the full model decodes), a LongTensor[rows] at every step, since rows advance on their own (a row
        that accepts more drafts stands further on).
    hidden_states: this layer's output for the active rows, [rows, length, d_model].
    previous_hidden_states: its input, same shape.
    rows: indices of the active rows in the batch, [rows]: in the rows `generate` decodes, so under beam search or
        `num_return_sequences` request i's beams are rows i * num_beams ... (i + 1) * num_beams - 1, and beams are
        reordered between steps (state kept per row across steps does not follow a beam).
    num_layers: layers of this part in the full model.
    max_steps: new tokens the generation may produce (threshold schedules decay over it); 1 in the encoder.
    attention_mask: [rows, length], 1 for real tokens (None: all real); the similarity ignores pads with it.
    logits_fn: computes the exit head's logits for the newest position, [rows, vocab]; called at most once. With a
        `draft_vocabulary` (speculative drafts), the tokens outside it are -inf.
    waiting: which of `rows` have not stopped yet, [rows] (None: all); rows that stopped may run on with the batch
        (`row_exit="keep"`), and a decision for the whole batch must not depend on whether they do.
    """

    part: ExitPart
    layer: int
    step: int | torch.Tensor
    hidden_states: torch.Tensor
    previous_hidden_states: torch.Tensor
    rows: torch.Tensor
    num_layers: int
    max_steps: int = 1
    attention_mask: torch.Tensor | None = None
    logits_fn: Callable[[], torch.Tensor] | None = None
    waiting: torch.Tensor | None = None
    _logits: torch.Tensor | None = field(default=None, repr=False)

    def logits(self) -> torch.Tensor:
        """The exit head's logits for the newest position, computed only if a controller asks."""
        if self._logits is None:
            if self.logits_fn is None:
                raise ValueError(f"No exit head is available for part {self.part!r}: use a similarity controller.")
            self._logits = self.logits_fn()
        return self._logits

    @property
    def computed_logits(self) -> torch.Tensor | None:
        """The exit head's logits if a controller asked for them, else None (never computes them)."""
        return self._logits


def options_text(first: object, attributes: dict, first_name: str) -> str:
    """`first`, then every other attribute as `name=value`: a repr that tells two objects of a class apart."""
    return ", ".join([repr(first), *(f"{name}={value!r}" for name, value in attributes.items() if name != first_name)])


def exp(value: "float | torch.Tensor") -> "float | torch.Tensor":
    return torch.exp(value) if isinstance(value, torch.Tensor) else math.exp(value)


class ThresholdSchedule:
    """A threshold as a function of the decoding step: `schedule(step, max_steps) -> float`, or a tensor [rows] for a
    threshold per row or a step per row (`ExitState.step` in speculative mode at batch > 1)."""

    def __init__(self, threshold: "float | torch.Tensor"):
        self.threshold = threshold

    def __call__(self, step: "int | torch.Tensor", max_steps: int) -> "float | torch.Tensor":
        return self.threshold

    def __repr__(self) -> str:  # with every option: calibration tells settings apart by it
        return f"{type(self).__name__}({options_text(self.threshold, vars(self), 'threshold')})"


class ConstantSchedule(ThresholdSchedule):
    """The same threshold at every step."""


class MuEPaperSchedule(ThresholdSchedule):
    """MuE's decay as the paper writes it: θ(t) = βθ + (1 − β)·exp(−t / (τN))."""

    def __init__(self, threshold: float, beta: float = 0.9, tau: float = 1.0):
        super().__init__(threshold)
        self.beta, self.tau = beta, tau

    def __call__(self, step: "int | torch.Tensor", max_steps: int) -> "float | torch.Tensor":
        return self.beta * self.threshold + (1 - self.beta) * exp(-step / (self.tau * max_steps))


class MuEOfficialSchedule(ThresholdSchedule):
    """MuE's decay as the official code does it: no exit (1.0) in the first third of the steps, then
    0.9θ + 0.1·exp(−(t + 1) / (N + 1)), N = max_steps (models/sequence_generator.py of `feature/MuE`)."""

    def __call__(self, step: "int | torch.Tensor", max_steps: int) -> "float | torch.Tensor":
        decayed = 0.9 * self.threshold + 0.1 * exp(-(step + 1) / (max_steps + 1))
        if isinstance(step, torch.Tensor):
            return torch.where(step < (max_steps + 1) / 3, 1.0, decayed)
        return 1.0 if step < (max_steps + 1) / 3 else decayed


class CALMSchedule(ThresholdSchedule):
    """CALM's decay: 0.9λ + 0.1·exp(−τ·t / N). CALM clips it to [0, 1], its confidence's range; for any λ in
    [−1, 1] it stays within [−0.9, 1], so no clip is needed, and a negative similarity threshold keeps its sign."""

    def __init__(self, threshold: float, tau: float = 4.0):
        super().__init__(threshold)
        self.tau = tau

    def __call__(self, step: "int | torch.Tensor", max_steps: int) -> "float | torch.Tensor":
        return 0.9 * self.threshold + 0.1 * exp(-self.tau * step / max_steps)


# In the order of `SCHEDULE_NAMES`, the names the knobs accept.
SCHEDULES = dict(
    zip(SCHEDULE_NAMES, (ConstantSchedule, MuEPaperSchedule, MuEOfficialSchedule, CALMSchedule), strict=True)
)


def per_row(
    threshold: "float | Sequence[float] | torch.Tensor | ThresholdSchedule",
) -> "float | torch.Tensor | ThresholdSchedule":
    """A threshold as a controller keeps it: a number or a schedule as given (a 0-d tensor or NumPy number as a
    number), a list or a 1-D tensor (one per row) as a float tensor. ValueError on another shape."""
    if isinstance(threshold, (int, float, ThresholdSchedule)):
        return threshold
    values = torch.as_tensor(threshold)
    if values.dim() == 0:  # a 0-d tensor or a NumPy number: the number itself
        return values.item()
    values = values.float()
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"A threshold is a number or one number per row (a list or a 1-D tensor), got {threshold!r}.")
    return values


def make_schedule(
    threshold: float | ThresholdSchedule, schedule: ThresholdScheduleName = "constant"
) -> ThresholdSchedule:
    if isinstance(threshold, ThresholdSchedule):
        return threshold
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown `exit_threshold_schedule` {schedule!r}; choose one of {list(SCHEDULES)}.")
    return SCHEDULES[schedule](threshold)


class ExitController:
    """Base class: after a layer, return a BoolTensor[rows] that is True for the rows that stop here.

    Subclass it and implement `__call__`; pass an instance to `generate(exit_controller=...)`. `reset()` is called
    before each generation, for controllers that keep state across layers.
    """

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(state) -> BoolTensor[rows].")

    def reset(self) -> None:
        """Forget any state kept from an earlier generation."""

    @property
    def keeps_state(self) -> bool:
        """Whether it keeps state across layers (it overrides `reset`): one instance then serves one `generate` call
        at a time."""
        return type(self).reset is not ExitController.reset


class ThresholdExit(ExitController):
    """A controller that compares a per-row score with a (possibly scheduled) threshold in [low, high]: the base of a
    new policy. Subclass it, set `score_range` and implement `score(state) -> [rows]`; thresholds per request and
    schedules then work as for the built-in policies."""

    score_range: tuple[float, float] = (0.0, 1.0)

    def __init__(
        self, threshold: "float | Sequence[float] | torch.Tensor | ThresholdSchedule", schedule: str = "constant"
    ):
        self.schedule = make_schedule(per_row(threshold), schedule)
        low, high = self.score_range
        values = torch.as_tensor(self.schedule.threshold, dtype=torch.float64)
        if not bool(((low <= values) & (values <= high)).all()):
            raise ValueError(
                f"`exit_threshold` for {type(self).__name__} must lie in [{low}, {high}], "
                f"got {self.schedule.threshold}."
            )

    def score(self, state: ExitState) -> torch.Tensor:
        """Per-row readiness to stop, [rows] (higher = readier)."""
        raise NotImplementedError

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        score = self.score(state)
        threshold = self.row_thresholds(state)
        if isinstance(threshold, torch.Tensor):
            threshold = threshold.to(score.device, score.dtype)
        return score > threshold

    def row_thresholds(self, state: ExitState) -> "float | torch.Tensor":
        """The running rows' thresholds, [rows] (or one number for all): the schedule at each row's step, for each row
        of the batch where the threshold is one per row."""
        base, step, device = self.schedule.threshold, state.step, state.hidden_states.device
        if not isinstance(base, torch.Tensor):
            return self.schedule(step, state.max_steps)
        try:  # no host read of the rows on this per-layer path: a short tensor fails the indexing itself
            if isinstance(step, torch.Tensor):  # each batch row's threshold at its own step (speculative, batch > 1)
                steps = torch.zeros(base.shape[0], dtype=step.dtype, device=base.device)
                steps[state.rows.to(base.device)] = step.to(base.device)
                step = steps
            threshold = self.schedule(step, state.max_steps)
            return threshold.to(device)[state.rows.to(device)] if isinstance(threshold, torch.Tensor) else threshold
        except IndexError:
            raise ValueError(
                f"{type(self).__name__} has {self.schedule.threshold.shape[0]} thresholds, one per row, fewer than the "
                "batch's rows: give one per row the model decodes (with beams or returned sequences, one per beam; "
                "the threshold knobs, such as `exit_threshold`, repeat a request's for them, a controller does not)."
            ) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({options_text(self.schedule, vars(self), 'schedule')})"


class SimilarityExit(ThresholdExit):
    """MuE: stop when a layer barely changes its input, cos(h_l, h_{l-1}) > threshold.

    reduction="row" compares each row's real tokens (flattened over tokens and channels); reduction="batch"
    flattens the rows still waiting into one vector, padding included, and gives every row the same decision, as the
    official MuE code does with its batch. Computed in float32 (float16 makes thresholds near 0.99 noisy).
    """

    score_range = POLICY_RANGES["similarity"]

    def __init__(self, threshold: float | ThresholdSchedule, schedule: str = "constant", reduction: str = "row"):
        super().__init__(threshold, schedule)
        if reduction not in ("row", "batch"):
            raise ValueError(f"Unknown similarity `reduction` {reduction!r}; choose 'row' or 'batch'.")
        self.reduction = reduction

    def score(self, state: ExitState) -> torch.Tensor:
        current, previous = state.hidden_states.float(), state.previous_hidden_states.float()
        rows = current.shape[0]
        if self.reduction == "batch":
            counted = slice(None) if state.waiting is None else state.waiting
            similarity = F.cosine_similarity(current[counted].reshape(1, -1), previous[counted].reshape(1, -1), dim=-1)
            return similarity.clamp(-1.0, 1.0).expand(rows)
        if state.attention_mask is not None:
            real = state.attention_mask[..., None].to(current.dtype)
            current, previous = current * real, previous * real
        # Rounding puts the cosine of equal vectors at 1.0000001 about half the time: above a threshold of 1.0.
        return F.cosine_similarity(current.reshape(rows, -1), previous.reshape(rows, -1), dim=-1).clamp(-1.0, 1.0)


class ConfidenceExit(ThresholdExit):
    """DEED / BLIPEE / CALM: stop when the exit head is confident about the newest token.

    measure="max_probability": the top softmax probability; "margin": top-1 minus top-2 probability;
    "entropy": 1 - H(p) / log(vocab), so that a one-hot distribution scores 1 and a uniform one 0.
    """

    MEASURES = ("max_probability", "margin", "entropy")

    def __init__(
        self, threshold: float | ThresholdSchedule, schedule: str = "constant", measure: str = "max_probability"
    ):
        super().__init__(threshold, schedule)
        if measure not in self.MEASURES:
            raise ValueError(f"Unknown confidence `measure` {measure!r}; choose one of {list(self.MEASURES)}.")
        self.measure = measure

    def score(self, state: ExitState) -> torch.Tensor:
        probabilities = state.logits().float().softmax(dim=-1)
        if self.measure == "max_probability":
            return probabilities.amax(dim=-1)
        if self.measure == "margin":
            top = probabilities.topk(2, dim=-1).values
            return top[:, 0] - top[:, 1]
        entropy = -(probabilities * probabilities.clamp_min(1e-12).log()).sum(dim=-1)
        return 1.0 - entropy / math.log(probabilities.shape[-1])


class PatienceExit(ExitController):
    """PABEE: stop when the exit head's argmax for the newest token has been the same for `patience` layers.

    The count restarts at each token's first layer asked (`min_exit_layer`, which need not be layer 1), per row.
    """

    def __init__(self, patience: int = 2):
        if patience < 1:
            raise ValueError(f"`patience` must be at least 1, got {patience}.")
        self.patience = patience
        self.reset()

    def reset(self) -> None:
        self._predictions = torch.empty(0, dtype=torch.long)
        self._streaks = torch.empty(0, dtype=torch.long)
        self._last_layer = 0

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        predictions = state.logits().argmax(dim=-1)
        rows = state.rows.to(predictions.device)
        size = int(rows.max()) + 1 if rows.numel() else 0
        if self._predictions.numel() < size or self._predictions.device != predictions.device:
            grown = torch.full((size,), -1, dtype=torch.long, device=predictions.device)
            grown[: self._predictions.numel()] = self._predictions.to(predictions.device)
            self._predictions = grown
            self._streaks = torch.zeros(size, dtype=torch.long, device=predictions.device)
        if state.layer <= self._last_layer:  # a new token's trip (or a new pass): nothing carries over
            self._predictions.fill_(-1)
        self._last_layer = state.layer
        same = self._predictions[rows] == predictions
        self._streaks[rows] = torch.where(same, self._streaks[rows] + 1, torch.ones_like(predictions))
        self._predictions[rows] = predictions
        return self._streaks[rows] >= self.patience

    def __repr__(self) -> str:
        return f"PatienceExit(patience={self.patience})"


class ExitControllerList(ExitController, list):
    """Stop a row when any controller in the list says stop (like `StoppingCriteriaList`)."""

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        decision = torch.zeros(state.rows.shape[0], dtype=torch.bool, device=state.hidden_states.device)
        for controller in self:
            decision |= checked_decision(controller(state), state, controller)
        return decision

    def reset(self) -> None:
        for controller in self:  # a plain callable is a controller too, with nothing to reset
            reset = getattr(controller, "reset", None)
            if callable(reset):
                reset()

    @property
    def keeps_state(self) -> bool:
        return any(getattr(controller, "keeps_state", False) for controller in self)


def checked_decision(decision: torch.Tensor, state: ExitState, controller: ExitController) -> torch.BoolTensor:
    """A controller's answer as a BoolTensor[rows], or a ValueError that names the controller. An integer tensor of
    0 and 1 passes (its values read once); a floating one, or an integer one holding other values, is refused, since
    a score cast to bool would stop every row where it is not 0."""
    if not isinstance(decision, torch.Tensor) or decision.shape != (state.rows.shape[0],):
        shape = tuple(decision.shape) if isinstance(decision, torch.Tensor) else type(decision).__name__
        raise ValueError(
            f"`exit_controller` {controller!r} must return a BoolTensor of shape ({state.rows.shape[0]},) "
            f"(one decision per active row), got {shape}."
        )
    if decision.dtype.is_floating_point or decision.dtype.is_complex:
        raise ValueError(
            f"`exit_controller` {controller!r} must return a BoolTensor (one decision per row), got {decision.dtype}: "
            "compare a score with a threshold (`ThresholdExit` does) rather than returning the score."
        )
    if decision.dtype == torch.bool:
        return decision
    if not bool(((decision == 0) | (decision == 1)).all()):
        raise ValueError(
            f"`exit_controller` {controller!r} must return a BoolTensor (one decision per row), got {decision.dtype} "
            f"values {sorted(set(decision.tolist()))}: an integer decision is 0 or 1."
        )
    return decision.to(torch.bool)


# Policy -> its controller and options; "patience" and "fixed_layer" are built apart: their thresholds count layers.
POLICIES = {
    "similarity": (SimilarityExit, {}),
    "confidence": (ConfidenceExit, {}),
    "margin": (ConfidenceExit, {"measure": "margin"}),  # CALM's top-2 softmax margin
}


def make_controller(
    policy: ExitPolicy = "similarity",
    threshold: float | ThresholdSchedule = 1.0,
    schedule: ThresholdScheduleName = "constant",
    **options,
) -> ExitController:
    """The controller `generate` builds from its knobs: `exit_policy`, `exit_threshold`, `exit_threshold_schedule`.

    For the patience policy, `exit_threshold` is the patience: how many layers in a row must agree; for the
    fixed_layer policy, the layer every row exits after (`FixedLayerExit`: the first exit point at or above it).
    """
    if policy not in POLICY_NAMES:
        raise ValueError(f"Unknown `exit_policy` {policy!r}; choose one of {list(POLICY_NAMES)}.")
    if policy in LAYER_POLICIES:
        check_layer_count("exit_threshold", threshold, schedule, policy)
        return (PatienceExit if policy == "patience" else FixedLayerExit)(int(threshold), **options)
    controller, defaults = POLICIES[policy]
    return controller(threshold, schedule, **{**defaults, **options})


class FixedLayerExit(ExitController):
    """Stop every row after a fixed number of layers: an exit budget, and the forced exit of benchmarks and tests.

    `layer` is an int, or a callable `(state) -> LongTensor[rows]` giving each active row its exit layer (e.g. by
    step and row, for mixed exit patterns).
    """

    def __init__(self, layer: int | Callable[[ExitState], torch.Tensor]):
        if not callable(layer) and (isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 1):
            raise ValueError(f"`layer` must be a positive int or a callable, got {layer!r}.")
        self.layer = layer

    def __call__(self, state: ExitState) -> torch.BoolTensor:
        rows, device = state.rows.shape[0], state.hidden_states.device
        if not callable(self.layer):
            return torch.full((rows,), state.layer >= self.layer, dtype=torch.bool, device=device)
        layers = torch.as_tensor(self.layer(state), device=device)
        if layers.dim() > 1 or layers.numel() not in (1, rows):
            raise ValueError(
                f"`FixedLayerExit`'s callable must give one exit layer, or one per active row ({rows},), got shape "
                f"{tuple(layers.shape)}."
            )
        return layers.expand(rows) <= state.layer

    def __repr__(self) -> str:
        return f"FixedLayerExit({self.layer!r})"


__all__ = [
    "ExitState",
    "ExitController",
    "SimilarityExit",
    "ConfidenceExit",
    "ThresholdExit",
    "PatienceExit",
    "ExitControllerList",
    "FixedLayerExit",
    "ThresholdSchedule",
    "ConstantSchedule",
    "MuEPaperSchedule",
    "MuEOfficialSchedule",
    "CALMSchedule",
    "make_controller",
    "make_schedule",
]
