"""Speculative mode (`exit_mode="speculative"`): the exits draft, the skipped layers verify, and the output is the
full model's: token for token when greedy, in distribution when sampling, at any batch size."""

import random

import pytest
import torch
from transformers import AutoModel, AutoProcessor, GenerationConfig, LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from hf_earlyexit.loading import EMBEDDED_MODEL_DIR
from hf_earlyexit.modeling.exit_controllers import ConfidenceExit, FixedLayerExit, SimilarityExit
from hf_earlyexit.modeling.exit_knobs import NO_EXIT
from hf_earlyexit.tasks import get_task
from tests.helpers import emitted_token, tiny_inputs, tiny_model

DEPTH = 4
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return tiny_model(decoder_layers=DEPTH, encoder_layers=2)


def mixed_lengths(batch: int, seed: int = 0) -> dict:
    """`tiny_inputs` with each row right-padded to its own length."""
    inputs = tiny_inputs(batch=batch, text_length=9, seed=seed, pad_last=0)
    for row in range(batch):
        pads = row % 4
        if pads:
            inputs["input_ids"][row, -pads - 1] = 2
            inputs["input_ids"][row, -pads:] = 1
            inputs["attention_mask"][row, -pads:] = 0
    return inputs


CONTROLLERS = {
    "fixed": lambda: FixedLayerExit(lambda state: (state.rows + state.step) % DEPTH + 1),
    "similarity": lambda: SimilarityExit(0.5),
    "confidence": lambda: ConfidenceExit(0.2),
}


def full_greedy(model, inputs, **kwargs):
    with torch.no_grad():
        return model.generate(**inputs, **{"max_new_tokens": NEW_TOKENS, "do_sample": False, **NO_EXIT, **kwargs})


def speculative(model, inputs, controller, **kwargs):
    with torch.no_grad():
        return model.generate(
            **inputs,
            exit_mode="speculative",
            exit_controller=controller,
            return_dict_in_generate=True,
            **{"max_new_tokens": NEW_TOKENS, **kwargs},
        )


@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("policy", sorted(CONTROLLERS))
def test_greedy_speculative_gives_the_full_models_tokens(model, batch, policy):
    inputs = mixed_lengths(batch, seed=batch)
    expected = full_greedy(model, inputs)
    for draft_tokens in (1, 2, 4, 8):
        out = speculative(model, inputs, CONTROLLERS[policy](), do_sample=False, num_assistant_tokens=draft_tokens)
        assert torch.equal(out.sequences, expected), (policy, draft_tokens)
        assert bool((out.accepted_tokens <= out.drafted_tokens).all())


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_drafts_at_a_fixed_layer_by_the_draft_knobs_give_the_full_models_tokens(model, schedule):
    inputs = mixed_lengths(4, seed=3)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, exit_mode="speculative", draft_exit_policy="fixed_layer",
            draft_exit_threshold=2, num_assistant_tokens_schedule=schedule, return_dict_in_generate=True,
        )  # fmt: skip
    assert torch.equal(out.sequences, full_greedy(model, inputs))
    assert set(out.exit_layers[out.exit_layers > 0].tolist()) <= {2, DEPTH} and int(out.accepted_tokens.sum()) > 0


def test_rows_that_finish_early_stop_where_the_full_model_does(model):
    inputs = mixed_lengths(8, seed=3)
    common = full_greedy(model, inputs)[:, 3].mode().values.item()  # a token several rows emit: their end
    expected = full_greedy(model, inputs, eos_token_id=common)
    assert len({int((row == common).nonzero()[0]) if (row == common).any() else -1 for row in expected}) > 1
    out = speculative(model, inputs, CONTROLLERS["fixed"](), num_assistant_tokens=4, eos_token_id=common)
    assert torch.equal(out.sequences, expected)
    # Above `draft_max_batch_size` the full model decodes, its exit layers 0 past each row's end as everywhere.
    full = full_greedy(model, inputs, eos_token_id=common, return_dict_in_generate=True)
    assert bool((full.exit_layers == 0).any())
    fallback = speculative(model, inputs, CONTROLLERS["fixed"](), eos_token_id=common, draft_max_batch_size=2)
    assert torch.equal(fallback.sequences, expected) and torch.equal(fallback.exit_layers, full.exit_layers)


class RowLayers(FixedLayerExit):
    """Each row drafts from its own layer; notes how many rows the decoder ran at each step's first question."""

    def __init__(self, layers: list[int]):
        table = torch.tensor(layers)
        super().__init__(lambda state: table[state.rows])
        self.decoder_rows: list[int] = []

    def __call__(self, state):
        if state.layer == 1:
            self.decoder_rows.append(state.hidden_states.shape[0])
        return super().__call__(state)


def test_finished_rows_leave_the_decoders_batch_and_each_row_keeps_its_own_exit(model):
    """A row that ended stops riding along in later rounds; the drafts' controller still sees the call's rows, so a
    per-row exit stays with its row after the batch shrank, and the output is the full model's."""
    inputs = mixed_lengths(4, seed=3)
    common = full_greedy(model, inputs)[:, 3].mode().values.item()  # a token several rows emit: their end
    expected = full_greedy(model, inputs, eos_token_id=common)
    layers = [1, 2, 3, 1]
    controller = RowLayers(layers)
    out = speculative(model, inputs, controller, num_assistant_tokens=3, eos_token_id=common)
    assert torch.equal(out.sequences, expected)
    assert controller.decoder_rows[0] == 4 and min(controller.decoder_rows) < 4
    for row, layer in enumerate(layers):
        emitted = out.exit_layers[row][out.exit_layers[row] > 0]
        assert set(emitted.tolist()) <= {layer, DEPTH}, row
    # A row that drafted on after others had left, at another place in the decoder's batch, had its drafts accepted.
    outlived = out.speculative_rounds > out.speculative_rounds.min()
    assert bool((outlived & out.accepted_tokens.gt(0)).any())


@pytest.mark.parametrize("new_tokens", [NEW_TOKENS, 4])
def test_a_round_drafts_on_past_rows_that_ended_while_the_others_have_room(model, new_tokens):
    """Row 0 drafts at full depth, so its first draft is the full model's token, here its end; row 1 drafts from the
    first layer. With room for more than a round, row 1 drafts all k tokens of that round; within a round of the
    length limit, the round ends with row 0's end, as it would for a short answer."""
    inputs = mixed_lengths(2, seed=5)
    end = int(full_greedy(model, inputs)[0, 1])  # row 0's first new token
    expected = full_greedy(model, inputs, eos_token_id=end, max_new_tokens=new_tokens)
    assert end not in expected[1, 1:4].tolist()  # row 1 goes on past the first round
    controller = RowLayers([DEPTH, 1])
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, exit_mode="speculative", exit_controller=controller,
            num_assistant_tokens=4, eos_token_id=end, return_dict_in_generate=True, do_sample=False,
        )  # fmt: skip
    assert torch.equal(out.sequences, expected)
    first_round = controller.decoder_rows.count(2)  # the draft steps before row 0 left the decoder's batch
    assert first_round == (4 if new_tokens - 1 > 4 else 1)


def test_speculative_mode_continues_from_the_sequences_not_from_a_cache(model):
    inputs = mixed_lengths(2, seed=2)
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, **NO_EXIT)
    prefix = dict(decoder_input_ids=first.sequences, decoder_attention_mask=torch.ones_like(first.sequences))
    out = speculative(model, {**inputs, **prefix}, FixedLayerExit(1))
    assert torch.equal(out.sequences, full_greedy(model, {**inputs, **prefix}))
    with pytest.raises(ValueError, match="empty cache"):
        speculative(model, {**inputs, **prefix, "past_key_values": first.past_key_values}, FixedLayerExit(1))


@pytest.mark.parametrize("batch", [1, 4])
def test_the_cache_holds_the_full_models_keys_and_values_of_the_accepted_tokens(model, batch):
    inputs = mixed_lengths(batch, seed=5)
    out = speculative(model, inputs, CONTROLLERS["fixed"](), num_assistant_tokens=3)
    assert bool(((0 < out.accepted_tokens) & (out.accepted_tokens < out.drafted_tokens)).any())  # drafts rejected
    with torch.no_grad():
        reference = model(**inputs, decoder_input_ids=out.sequences[:, :-1], use_cache=True)
    cache, expected = out.past_key_values.self_attention_cache, reference.past_key_values.self_attention_cache
    # Nothing of a rejected draft remains: each row's tokens but its newest, in order, as in the full model's cache.
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    for row, cached in enumerate((out.exit_layers > 0).sum(dim=1).tolist()):  # the start token, new tokens, - 1
        assert bool((cache.frontier[row, :cached] == DEPTH).all())
        for ours, theirs in zip(cache.layers, expected.layers, strict=True):
            torch.testing.assert_close(ours.keys[row, :, :cached], theirs.keys[row, :, :cached], rtol=0, atol=1e-5)
            torch.testing.assert_close(ours.values[row, :, :cached], theirs.values[row, :, :cached], rtol=0, atol=1e-5)


@pytest.mark.parametrize("ending", [False, True])
@pytest.mark.parametrize("passed", [False, True])
def test_the_full_model_continues_from_the_cache(model, ending, passed):
    """The cache a dict output returns, or the one the caller passed in: also for rows that ended before the others,
    past a row's end it holds what the full model computes on the tokens it feeds there (its end token, then pads),
    once a later call reads it."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from hf_earlyexit.modeling.early_exit_cache import EarlyExitCache

    inputs = mixed_lengths(4, seed=3)
    end = full_greedy(model, inputs)[:, 3].mode().values.item() if ending else None  # a token several rows emit
    cache = EncoderDecoderCache(EarlyExitCache(model.config, "recompute"), DynamicCache()) if passed else None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, exit_mode="speculative", num_assistant_tokens=3,
                             exit_controller=CONTROLLERS["fixed"](), eos_token_id=end, past_key_values=cache,
                             return_dict_in_generate=not passed)  # fmt: skip
    sequences, cache = (out, cache) if passed else (out.sequences, out.past_key_values)
    assert bool((sequences[:, -1] == 1).any()) == ending  # a row that ended before the longest one
    prefix = dict(decoder_input_ids=sequences, decoder_attention_mask=torch.ones_like(sequences))
    continued = full_greedy(model, {**inputs, **prefix, "past_key_values": cache}, eos_token_id=None)
    assert torch.equal(continued, full_greedy(model, {**inputs, **prefix}, eos_token_id=None))


def test_exit_layers_and_acceptance_statistics(model):
    inputs = mixed_lengths(4, seed=7)
    out = speculative(model, inputs, FixedLayerExit(2), num_assistant_tokens=4)
    new = out.sequences.shape[1] - 1
    assert out.exit_layers.shape == (4, new)
    generated = out.exit_layers > 0
    # A token came from a draft (layer 2) or from the full model (every layer): the drafts are the accepted ones.
    assert set(out.exit_layers[generated].unique().tolist()) <= {2, DEPTH}
    assert torch.equal((out.exit_layers == 2).sum(dim=1), out.accepted_tokens)
    # Each round ends with the full model's own token, unless the row ended on an accepted draft.
    assert bool((out.speculative_rounds >= (out.exit_layers == DEPTH).sum(dim=1)).all())


class StepLog(FixedLayerExit):
    """Drafts from layer 1, noting each row's `state.step`."""

    def __init__(self):
        super().__init__(1)
        self.steps: dict[int, list[int]] = {}
        self.kinds: set[type] = set()

    def __call__(self, state):
        self.kinds.add(type(state.step))
        steps = state.step if isinstance(state.step, torch.Tensor) else torch.full_like(state.rows, state.step)
        for row, step in zip(state.rows.tolist(), steps.tolist(), strict=True):
            self.steps.setdefault(row, []).append(step)
        return super().__call__(state)


def test_each_row_sees_its_own_step_as_rows_advance_apart(model):
    log = StepLog()
    out = speculative(model, mixed_lengths(4, seed=7), log, num_assistant_tokens=4)
    assert len(set(out.accepted_tokens.tolist())) > 1  # the rows stand at different steps
    new_tokens = (out.exit_layers > 0).sum(dim=1)
    for row, steps in log.steps.items():
        # A draft of new token t (0-based) sees step t; a row that ended rides along one past its last token, as in
        # the full model's loop. A step counted in slots reached 12 here.
        assert max(steps) <= min(int(new_tokens[row]), NEW_TOKENS - 1), (row, steps)
        assert steps[0] == 0
    assert log.kinds == {torch.Tensor}  # one type through the call, not an int until a row first skips a slot
    alone = StepLog()
    speculative(model, mixed_lengths(1), alone, num_assistant_tokens=4)
    assert alone.kinds == {int}  # at batch 1 every rejected slot is cropped: one step for the batch


def test_a_call_with_more_rows_than_draft_max_batch_size_decodes_in_full(model):
    inputs = mixed_lengths(4, seed=2)
    full = full_greedy(model, inputs, return_dict_in_generate=True)
    expected, full_strategy = full.sequences, full.past_key_values.self_attention_cache.kv_strategy
    for limit, drafts in ((3, False), (4, True)):
        out = speculative(model, inputs, FixedLayerExit(1), num_assistant_tokens=4, draft_max_batch_size=limit)
        assert torch.equal(out.sequences, expected), limit
        assert bool((out.drafted_tokens > 0).any()) == drafts, limit
        # Without drafts, the full model's cache too (a `recompute` one costs time even where nothing exits).
        strategy = out.past_key_values.self_attention_cache.kv_strategy
        assert strategy == ("recompute" if drafts else full_strategy), limit
    assert not bool(out.speculative_rounds.eq(0).any())
    limited = speculative(model, inputs, FixedLayerExit(1), draft_max_batch_size=2)
    assert set(limited.exit_layers.unique().tolist()) == {DEPTH}  # every token the full model's own
    assert not bool(limited.drafted_tokens.any() or limited.accepted_tokens.any() or limited.speculative_rounds.any())
    with torch.no_grad():  # without `return_dict_in_generate`, the sequences alone
        plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, exit_mode="speculative", exit_threshold=0.5,
                               draft_max_batch_size=1)  # fmt: skip
    assert torch.equal(plain, expected)


def test_draft_max_batch_size_counts_decoder_rows_and_sampling_above_it_is_the_full_models(model):
    inputs, sampling = mixed_lengths(2, seed=4), dict(do_sample=True, num_return_sequences=2)  # 4 decoder rows
    with torch.no_grad():
        torch.manual_seed(11)
        expected = model.generate(**inputs, max_new_tokens=NEW_TOKENS, **sampling, **NO_EXIT)
    torch.manual_seed(11)
    out = speculative(model, inputs, FixedLayerExit(1), draft_max_batch_size=3, **sampling)
    assert torch.equal(out.sequences, expected) and not bool(out.drafted_tokens.any())


def test_a_draft_vocabulary_gives_the_full_models_tokens_and_drafts_only_its_tokens(model):
    inputs = mixed_lengths(4, seed=6)
    expected = full_greedy(model, inputs)
    emitted = expected[:, 1:].flatten().unique().tolist()
    vocabulary = [*emitted[::2], 5, 6, 7]  # half the tokens the full model emits are never drafted
    controllers = {**CONTROLLERS, "never_ready": lambda: FixedLayerExit(DEPTH)}  # drafts that run every layer
    for policy, controller in controllers.items():
        out = speculative(model, inputs, controller(), num_assistant_tokens=4, draft_vocabulary=vocabulary)
        assert torch.equal(out.sequences, expected), policy
        drafted = out.sequences[:, 1:][(out.exit_layers > 0) & (out.exit_layers < DEPTH)]  # the accepted drafts
        assert set(drafted.tolist()) <= set(vocabulary), policy
    assert int(out.accepted_tokens.sum()) > 0


def test_a_draft_vocabulary_the_processors_leave_nothing_of_still_gives_the_full_models_tokens(model):
    inputs, vocabulary = mixed_lengths(4, seed=1), [5, 6, 7]
    suppressed = dict(suppress_tokens=vocabulary)  # every draft scores -inf everywhere
    expected = full_greedy(model, inputs, **suppressed)
    out = speculative(model, inputs, FixedLayerExit(1), draft_vocabulary=vocabulary, **suppressed)
    assert torch.equal(out.sequences, expected)
    torch.manual_seed(3)
    sampled = speculative(model, inputs, FixedLayerExit(1), draft_vocabulary=vocabulary, do_sample=True, **suppressed)
    assert not set(sampled.sequences.flatten().tolist()) & set(vocabulary)


@pytest.mark.parametrize(
    ("warpers", "vocabulary"),
    [({}, None), ({"temperature": 0.7, "top_k": 5}, None), ({"top_k": 5}, [2, 3, 5, 6, 8])],
    ids=["plain", "warped", "draft_vocabulary"],
)
def test_sampling_follows_the_full_models_distribution(warpers, vocabulary):
    vocab = 10
    model = tiny_model(decoder_layers=3, encoder_layers=1, vocab_size=vocab, seed=3)
    inputs = {name: tensor[:1] for name, tensor in tiny_inputs(batch=1, pad_last=0).items()}
    inputs["input_ids"] = inputs["input_ids"] % (vocab - 3) + 3
    rows, calls = 5000, 4
    batch = {name: tensor.expand(rows, *tensor.shape[1:]) for name, tensor in inputs.items()}
    pairs = []
    torch.manual_seed(0)
    for _ in range(calls):
        out = speculative(
            model,
            batch,
            FixedLayerExit(1),
            do_sample=True,
            num_assistant_tokens=3,
            max_length=4,
            draft_vocabulary=vocabulary,
            **warpers,
        )
        pairs.append(out.sequences[:, 1:3])
    assert int(out.accepted_tokens.sum()) > 0 and bool((out.accepted_tokens < out.drafted_tokens).any())
    counts = torch.zeros(vocab, vocab)
    for first, second in torch.cat(pairs).tolist():
        counts[first, second] += 1
    expected = full_pair_distribution(model, inputs, vocab, **warpers) * rows * calls
    assert chi_square_p_value(counts, expected) > 0.01


def full_pair_distribution(model, inputs, vocab: int, temperature: float = 1.0, top_k: int | None = None):
    """P(first, second) of the full model's first two sampled tokens, [vocab, vocab] (after the end token, pad)."""

    def warped(logits):
        logits = logits / temperature
        if top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1:], -torch.inf)
        return logits.softmax(dim=-1)

    start = model.config.decoder_start_token_id
    decoder_input_ids = torch.tensor([[start, token] for token in range(vocab)])
    expanded = {name: tensor.expand(vocab, *tensor.shape[1:]) for name, tensor in inputs.items()}
    with torch.no_grad():
        logits = model(**expanded, decoder_input_ids=decoder_input_ids).logits.float()
    first = warped(logits[0, 0])
    pairs = first[:, None] * warped(logits[:, 1])
    end, pad = model.config.eos_token_id, model.config.pad_token_id
    pairs[end] = 0
    pairs[end, pad] = first[end]
    return pairs


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against expected counts; cells expected below 5 are pooled."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    small = expected < 5
    assert float(observed[expected == 0].sum()) == 0  # nothing the full model cannot sample
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    freedom = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2.0), statistic / 2))


def test_a_seed_reproduces_speculative_samples(model):
    inputs = mixed_lengths(4)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(speculative(model, inputs, FixedLayerExit(1), do_sample=True, num_assistant_tokens=3).sequences)
    assert torch.equal(*runs)


def test_sampled_return_sequences_and_the_heuristic_schedule(model):
    inputs = mixed_lengths(2)
    torch.manual_seed(0)
    out = speculative(
        model,
        inputs,
        FixedLayerExit(2),
        do_sample=True,
        num_return_sequences=3,
        num_assistant_tokens=2,
        num_assistant_tokens_schedule="heuristic",
    )
    assert out.sequences.shape[0] == 6 and out.drafted_tokens.shape == (6,)


class Collector(BaseStreamer):
    def __init__(self):
        self.tokens, self.puts, self.ended = [], [], False

    def put(self, value):
        self.tokens += value.flatten().tolist()
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_a_streamer_receives_the_tokens_as_they_are_accepted(model):
    inputs = mixed_lengths(1)
    streamer = Collector()
    out = speculative(model, inputs, FixedLayerExit(1), streamer=streamer, num_assistant_tokens=4)
    assert streamer.tokens == out.sequences[0].tolist() and streamer.ended


@pytest.mark.parametrize("batch", [1, 4])
def test_a_streamer_gets_what_stock_generate_puts(model, batch):
    """One [batch] tensor per position, each row's token there, pads only past a row's end: rows that accepted
    more than others in a round wait for them."""
    inputs = mixed_lengths(batch, seed=1)
    common = full_greedy(model, inputs)[:, 3].mode().values.item()  # rows end at different lengths
    stock, streamer = Collector(), Collector()
    full_greedy(model, inputs, streamer=stock, eos_token_id=common)
    out = speculative(model, inputs, CONTROLLERS["fixed"](), streamer=streamer, num_assistant_tokens=4,
                      eos_token_id=common)  # fmt: skip
    assert batch == 1 or len(set(out.accepted_tokens.tolist())) > 1  # rows emit different counts per round
    assert all(put.shape == (batch,) and put.device.type == "cpu" for put in streamer.puts[1:])
    assert len(streamer.puts) == len(stock.puts) and streamer.ended
    for ours, theirs in zip(streamer.puts, stock.puts, strict=True):
        assert torch.equal(ours.flatten(), theirs.flatten())


class PerRequestBias(LogitsProcessor):
    """One favoured token per request, added in place: the processor keys on a row's index and writes its input."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores):
        scores[torch.arange(scores.shape[0]), self.tokens] += 5.0
        return scores


def low_or_high(batch_id: int, prefix: torch.Tensor) -> list[int]:
    """Even requests take low ids, odd ones high ids or the end token."""
    return list(range(3, 60)) if batch_id % 2 == 0 else [*range(60, 120), 2]


@pytest.mark.parametrize(
    "constraint",
    [dict(prefix_allowed_tokens_fn=low_or_high), dict(logits_processor=[PerRequestBias([10, 20, 30, 40])])],
    ids=["prefix_allowed_tokens_fn", "per_request_processor"],
)
def test_processors_that_key_on_the_rows_index_see_the_whole_batch(model, constraint):
    inputs = mixed_lengths(4, seed=1)
    expected = full_greedy(model, inputs, **constraint)
    out = speculative(model, inputs, CONTROLLERS["fixed"](), num_assistant_tokens=4, **constraint)
    assert len(set(out.accepted_tokens.tolist())) > 1  # the rows' lengths part: processors run per length
    assert torch.equal(out.sequences, expected)
    if "prefix_allowed_tokens_fn" in constraint:
        for row, new in enumerate(out.sequences[:, 1:].tolist()):
            ends = {model.generation_config.eos_token_id, model.generation_config.pad_token_id}  # forced end, padding
            assert set(new) <= set(low_or_high(row, out.sequences[row])) | ends, row


class PerRequestStop(StoppingCriteria):
    """One stop token per request: the criterion keys on a row's index."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.tokens


class ConfidentStop(StoppingCriteria):
    """Stops a row once its last processed scores are confident: reads the scores, as stock `generate` gives them
    under `output_scores`."""

    def __call__(self, input_ids, scores, **kwargs):
        return scores[-1].softmax(dim=-1).max(dim=-1).values > 0.2


def test_stopping_criteria_get_the_scores_so_far_and_finished_rows_are_certain_of_their_pad(model):
    inputs = mixed_lengths(4, seed=1)
    scored = {"output_scores": True, "stopping_criteria": [ConfidentStop()]}
    expected = full_greedy(model, inputs, return_dict_in_generate=True, **scored)
    ends = (expected.sequences[:, 1:] != model.generation_config.pad_token_id).sum(dim=1)
    assert len(set(ends.tolist())) > 1  # rows end at different lengths
    out = speculative(model, inputs, CONTROLLERS["fixed"](), num_assistant_tokens=4, **scored)
    assert torch.equal(out.sequences, expected.sequences)
    ours = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    theirs = model.compute_transition_scores(expected.sequences, expected.scores, normalize_logits=True)
    assert bool(ours.isfinite().all())  # a finished row's pad is certain: no NaN from an all -inf step
    for row, end in enumerate(ends.tolist()):
        torch.testing.assert_close(ours[row, :end], theirs[row, :end], atol=1e-4, rtol=1e-4)
        assert not ours[row, end:].any()


def padded_decoder_prompts(prompts: list[list[int]], side: str) -> dict:
    """`decoder_input_ids` and `decoder_attention_mask` of `prompts` padded (pad id 1) on `side` to the longest."""
    width = max(map(len, prompts))

    def padded(row: list[int], pad: int) -> list[int]:
        pads = [pad] * (width - len(row))
        return pads + row if side == "left" else row + pads

    return {
        "decoder_input_ids": torch.tensor([padded(prompt, 1) for prompt in prompts]),
        "decoder_attention_mask": torch.tensor([padded([1] * len(prompt), 0) for prompt in prompts]),
    }


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_decoder_prompts_give_the_full_models_tokens(model, side):
    """Left pads count no position; pads after a row's first token (right-padded prompts, or continuing sequences
    whose ended rows are masked) count, as in the full model."""
    inputs = mixed_lengths(4, seed=2)
    padded = padded_decoder_prompts([[0, 17, 33], [0, 45], [0], [0, 9, 9]], side)
    expected = full_greedy(model, {**inputs, **padded})
    for policy in ("fixed", "confidence"):
        out = speculative(model, {**inputs, **padded}, CONTROLLERS[policy](), num_assistant_tokens=4)
        assert torch.equal(out.sequences, expected), policy


def random_combination(model, seed: int) -> tuple[dict, dict, dict]:
    """Inputs, decoding options and draft settings that combine features at random: padded image-text prompts and
    decoder prompts, rows that end apart, prefix-reading processors, a draft vocabulary, the heuristic schedule."""
    rng = random.Random(seed)
    batch = rng.randint(1, 6)
    inputs = tiny_inputs(batch=batch, text_length=rng.randint(4, 9), seed=seed, pad_last=rng.randint(0, 3))
    if rng.random() < 0.5:
        prompts = [[0] + [rng.randrange(3, 120) for _ in range(rng.randint(0, 3))] for _ in range(batch)]
        inputs |= padded_decoder_prompts(prompts, rng.choice(["left", "right"]))
    options = {"max_new_tokens": rng.randint(1, 12)}
    if rng.random() < 0.6:
        options["eos_token_id"] = emitted_token(model, inputs, rng, new_tokens=6)
    options |= rng.choice([{}, {"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": 3}])
    drafts = {"num_assistant_tokens": rng.randint(1, 8)}
    if rng.random() < 0.4:
        drafts["num_assistant_tokens_schedule"] = "heuristic"
    if rng.random() < 0.4:
        drafts["draft_vocabulary"] = sorted(rng.sample(range(model.config.vocab_size), rng.randint(3, 60)))
    return inputs, options, drafts


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", sorted(CONTROLLERS))
def test_random_combinations_of_features_give_the_full_models_tokens(model, seed, policy):
    inputs, options, drafts = random_combination(model, seed)
    expected = full_greedy(model, inputs, **options)
    out = speculative(model, inputs, CONTROLLERS[policy](), do_sample=False, **{**options, **drafts})
    assert torch.equal(out.sequences, expected), (options, drafts)


def test_stopping_criteria_that_key_on_the_rows_index_see_the_whole_batch(model):
    inputs = mixed_lengths(4, seed=1)
    plain = full_greedy(model, inputs)
    criteria = [PerRequestStop(plain[:, 4].tolist())]  # each request stops at its fourth new token
    expected = full_greedy(model, inputs, stopping_criteria=criteria)
    assert expected.shape[1] == 5
    out = speculative(model, inputs, CONTROLLERS["fixed"](), num_assistant_tokens=4, stopping_criteria=criteria)
    assert torch.equal(out.sequences, expected)


def test_speculative_can_be_the_saved_default(model, tmp_path):
    vocabulary = list(range(3, 120, 2))
    with torch.no_grad():
        expected = model.generate(**mixed_lengths(2), max_new_tokens=NEW_TOKENS, **NO_EXIT)
    saved = dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary=vocabulary)
    for name, value in saved.items():
        setattr(model.generation_config, name, value)
    try:
        model.save_pretrained(tmp_path)
    finally:
        for name in saved:
            delattr(model.generation_config, name)
    loaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        out = loaded.generate(**mixed_lengths(2), max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    assert int(out.drafted_tokens.sum()) > 0 and torch.equal(out.sequences, expected)
    drafted = out.sequences[:, 1:][(out.exit_layers > 0) & (out.exit_layers < DEPTH)]
    assert set(drafted.tolist()) <= set(vocabulary)


def test_saved_draft_knobs_drive_the_drafts_and_only_them(model):
    saved = dict(exit_policy="confidence", exit_threshold=1.0, draft_exit_threshold=0.0)  # lossy: never ready
    for name, value in saved.items():
        setattr(model.generation_config, name, value)
    inputs = mixed_lengths(2)
    try:
        with torch.no_grad():
            drafting = model.generate(
                **inputs, max_new_tokens=NEW_TOKENS, exit_mode="speculative", return_dict_in_generate=True
            )
            lossy = model.generate(**inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
            named = model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                exit_mode="speculative",
                exit_threshold=1.0,
                return_dict_in_generate=True,
            )
    finally:
        for name in saved:
            delattr(model.generation_config, name)
    assert int(drafting.drafted_tokens.sum()) > 0
    assert set(drafting.exit_layers[drafting.exit_layers > 0].tolist()) <= {1, DEPTH}  # drafts at the first layer
    assert torch.equal(drafting.sequences, full_greedy(model, inputs))
    assert set(lossy.exit_layers[lossy.exit_layers > 0].tolist()) == {DEPTH}  # the draft knobs leave lossy mode be
    assert set(named.exit_layers[named.exit_layers > 0].tolist()) == {DEPTH}  # a call naming the exit drafts with it


def test_a_bad_saved_draft_threshold_is_refused_in_every_mode(model):
    model.generation_config.exit_policy, model.generation_config.draft_exit_threshold = "confidence", 1.5
    try:
        for mode in ("exit", "speculative"):
            with pytest.raises(ValueError, match="draft_exit_threshold"):
                model.generate(**mixed_lengths(1), max_new_tokens=3, exit_mode=mode, exit_controller=FixedLayerExit(1))
    finally:
        del model.generation_config.exit_policy, model.generation_config.draft_exit_threshold


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(exit_mode="speculative", exit_threshold=0.5, num_beams=2), "num_beams"),
        (dict(exit_mode="speculative", exit_threshold=0.5, prompt_lookup_num_tokens=2), "prompt_lookup_num_tokens"),
        (dict(exit_threshold=0.5, prompt_lookup_num_tokens=2), "lossy decoder exits"),
        (dict(exit_mode="speculative"), "exit_threshold"),
        (dict(exit_mode="speculative", exit_threshold=0.5, kv_strategy="copy"), "kv_strategy"),
        (dict(exit_mode="speculative", exit_threshold=0.5, row_exit="keep"), "row_exit"),
        (dict(exit_mode="speculative", exit_threshold=0.5, exit_token_layer="batch"), "exit_token_layer"),
        (
            dict(exit_mode="speculative", exit_threshold=0.5, max_exit_layer=1),
            r"sets these knobs itself.*drop \['max_exit_layer=1'\]",
        ),
        (dict(exit_mode="speculative", exit_threshold=0.5, encoder_exit_threshold=0.9), "encoder_exit_threshold"),
        (dict(exit_mode="speculative", exit_threshold=0.5, output_hidden_states=True), "output_hidden_states"),
        (dict(exit_mode="lossless"), "exit_mode"),
        (dict(exit_threshold=0.5, draft_exit_threshold=0.3), r"\['draft_exit_threshold'\] set speculative.*lossy"),
        (dict(draft_max_batch_size=4, draft_vocabulary=[3, 4]), r"\['draft_max_batch_size', 'draft_vocabulary'\]"),
        (dict(exit_mode="speculative", draft_exit_policy="random", draft_exit_threshold=0.5), "draft_exit_policy"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_max_batch_size=0), "draft_max_batch_size"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_max_batch_size=2.5), "draft_max_batch_size"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_max_batch_size=True), "draft_max_batch_size"),
        (dict(exit_mode="speculative", exit_threshold=0.5, num_assistant_tokens=0), "num_assistant_tokens"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary=[]), "draft_vocabulary"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary=[3, 3]), "draft_vocabulary"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary=[3, 10**6]), "draft_vocabulary"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary=[True, 4]), "draft_vocabulary"),
        (dict(exit_mode="speculative", exit_threshold=0.5, draft_vocabulary="the cat"), "draft_vocabulary"),
        (dict(exit_mode="speculative", exit_threshold=0.5, num_assistant_tokens=2.5), "num_assistant_tokens"),
        (
            dict(exit_mode="speculative", exit_threshold=0.5, num_assistant_tokens_schedule="fast"),
            "num_assistant_tokens_schedule",
        ),
        (
            dict(
                exit_mode="speculative", exit_threshold=0.5, generation_config=GenerationConfig(output_attentions=True)
            ),
            "output_attentions",
        ),
    ],
)
def test_refusals_name_the_knob(model, knobs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(**mixed_lengths(1), max_new_tokens=3, **knobs)


def test_an_assistant_model_is_refused_with_exits(model):
    for knobs in (dict(exit_threshold=0.5), dict(exit_mode="speculative", exit_threshold=0.5)):
        with pytest.raises(ValueError, match="assistant_model"):
            model.generate(**mixed_lengths(1), max_new_tokens=3, assistant_model=model, **knobs)
    with pytest.raises(ValueError, match='assistant_early_exit.*exit_mode="speculative"'):  # never an AttributeError
        model.generate(**mixed_lengths(1), max_new_tokens=3, assistant_early_exit=2, **NO_EXIT)


def test_without_exits_an_assistant_drafts_with_its_own_defaults_and_the_output_is_the_full_models(model):
    """Transformers hands the assistant this call's model kwargs: the call's exit settings stay with this model."""
    assistant = tiny_model(decoder_layers=DEPTH, encoder_layers=2, exit_threshold=0.5, exit_policy="confidence")
    inputs = mixed_lengths(1)
    with torch.no_grad():
        assisted = model.generate(**inputs, max_new_tokens=NEW_TOKENS, assistant_model=assistant, **NO_EXIT)
    assert torch.equal(assisted, full_greedy(model, inputs))


def test_assisted_decoding_reports_each_new_tokens_layers_and_takes_encoder_exits(model):
    """One verification pass keeps several tokens: `exit_layers` had one entry per pass (6 for 19 tokens)."""
    inputs = mixed_lengths(1)
    for assisted in (dict(assistant_model=model), dict(prompt_lookup_num_tokens=3)):
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, **assisted, **NO_EXIT)
        assert torch.equal(out.sequences, full_greedy(model, inputs))
        assert out.exit_layers.tolist() == [[DEPTH] * (out.sequences.shape[1] - 1)]
    # Encoder exits leave the verification to the full decoder: the output is greedy's with the same encoder exit.
    knobs = {**NO_EXIT, "encoder_exit_threshold": 0.0}
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, prompt_lookup_num_tokens=3, **knobs)
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=NEW_TOKENS, **knobs))


def test_generation_kwargs_forward_does_not_take_stay_with_generate(model):
    """Transformers carries prefill's `position_ids` and an `assistant_model` it ignores under beams among the model
    kwargs: each failed with `forward() got an unexpected keyword argument`."""
    inputs = mixed_lengths(1)
    chunked = model.generate(**inputs, max_new_tokens=NEW_TOKENS, prefill_chunk_size=2, **NO_EXIT)
    assert torch.equal(chunked, full_greedy(model, inputs))
    beams = dict(max_new_tokens=NEW_TOKENS, num_beams=2, **NO_EXIT)
    assert torch.equal(model.generate(**inputs, assistant_model=model, **beams), model.generate(**inputs, **beams))


def test_a_cache_passed_in_that_cannot_hold_exact_keys_and_values_is_refused_by_name(model):
    from transformers.cache_utils import DynamicCache

    from hf_earlyexit.modeling.early_exit_cache import EarlyExitCache

    for cache in (EarlyExitCache(model.config), DynamicCache()):  # built for `propagate`; not ours
        with pytest.raises(ValueError, match='speculative.*empty `EarlyExitCache\\(config, "recompute"\\)`'):
            speculative(model, mixed_lengths(1), FixedLayerExit(1), past_key_values=cache)


@pytest.mark.parametrize("batch", [1, 4])
def test_the_embedded_model_through_remote_code_gives_its_full_models_captions(batch):
    model = AutoModel.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True)
    rows = get_task("caption").dataset("test", size=8)
    drafted = accepted = 0
    for start in range(0, 8, batch):
        chunk = rows.select(range(start, start + batch))
        inputs = processor(images=list(chunk["image"]), text=list(chunk["prompt"]), return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(**inputs, max_new_tokens=24, **NO_EXIT)
            out = model.generate(**inputs, max_new_tokens=24, exit_mode="speculative", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        drafted, accepted = drafted + int(out.drafted_tokens.sum()), accepted + int(out.accepted_tokens.sum())
    assert accepted > 0.6 * drafted  # a trained model's exits draft well


def test_a_model_that_sets_no_draft_length_drafts_four_tokens_a_round(model):
    """Transformers' own default, 20 drafts a round, is for a separate assistant model; ours draft with a shallow
    exit, whose drafts go wrong sooner."""
    assert model.generation_config.num_assistant_tokens is None
    with torch.no_grad():
        out = model.generate(**mixed_lengths(1), max_new_tokens=30, min_new_tokens=30, exit_mode="speculative",
                             exit_controller=FixedLayerExit(1), return_dict_in_generate=True)  # fmt: skip
    drafted, rounds = int(out.drafted_tokens[0]), int(out.speculative_rounds[0])
    assert 3 * rounds < drafted <= 4 * rounds
