"""Early exit in the model and in `generate`: invariants, the KV strategies, encoder exits, knobs and bad input."""

import random
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_earlyexit.modeling import modeling_ofa
from hf_earlyexit.modeling.early_exit_cache import EarlyExitCache
from hf_earlyexit.modeling.exit_controllers import ConfidenceExit, ExitController, FixedLayerExit, PatienceExit
from hf_earlyexit.modeling.exit_knobs import KV_STRATEGIES, NO_EXIT
from hf_earlyexit.modeling.generation_early_exit import EarlyExitSettings, new_cache
from hf_earlyexit.modeling.modeling_ofa import OFADecoder
from hf_earlyexit.modeling.row_exits import LayerCosts, RowExits
from tests.helpers import emitted_token, tiny_config, tiny_inputs, tiny_model

DEPTH = 4  # decoder layers of the models here
NEW_TOKENS = 7


@pytest.fixture(scope="module")
def model():
    return tiny_model(decoder_layers=DEPTH, encoder_layers=3)


def batch_of(size: int) -> dict:
    return tiny_inputs(batch=size, pad_last=2 if size > 1 else 0, seed=size)


def generate(model, inputs, mode: str, **kwargs):
    options = {
        "greedy": dict(do_sample=False),
        "sample": dict(do_sample=True, top_k=20),
        "beam": dict(num_beams=3, num_return_sequences=2),
    }[mode]
    torch.manual_seed(0)
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_scores=True, **options, **kwargs
    )


def generated_layers(out) -> torch.Tensor:
    """The exit layers of the tokens generated before each row's end (0 after it)."""
    return out.exit_layers[out.exit_layers > 0]


class NeverExit(ExitController):
    """Asks at every layer and never stops: the exit code path with the full model's result."""

    def __call__(self, state):
        return torch.zeros(state.rows.shape[0], dtype=torch.bool)


def mixed_exits(offset: int = 0) -> FixedLayerExit:
    """A forced exit layer that varies by row (batch row + offset) and step: 1, 2, 3 or full depth."""
    return FixedLayerExit(lambda state: (state.rows + offset + 2 * state.step) % DEPTH + 1)


# --- no exit = the full model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("strategy", KV_STRATEGIES)
def test_exits_that_never_fire_give_the_full_model(model, mode, size, strategy):
    inputs = batch_of(size)
    full = generate(model, inputs, mode)
    for knobs in (
        dict(exit_threshold=None),
        dict(exit_threshold=1.0),  # a cosine similarity is never strictly above 1
        dict(exit_policy="confidence", exit_threshold=1.0),
        dict(exit_controller=NeverExit()),
    ):
        out = generate(model, inputs, mode, kv_strategy=strategy, **knobs)
        assert torch.equal(out.sequences, full.sequences), knobs
        for ours, theirs in zip(out.scores, full.scores, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert bool((out.exit_layers[out.exit_layers > 0] == DEPTH).all())
    assert full.exit_layers.shape == (full.sequences.shape[0], full.sequences.shape[1] - 1)
    assert bool((full.encoder_exit_layers == 3).all())


@pytest.mark.parametrize(
    "end_tokens", [dict(decoder_start_token_id=2), dict(eos_token_id=[2, 0])], ids=["bart", "list"]
)
def test_a_start_token_that_is_an_end_token_does_not_end_the_row(model, end_tokens):
    """BART starts decoding with its end token: the row fed it has generated nothing yet, so it is not finished (a
    finished row leaves at the first exit)."""
    inputs = batch_of(2)
    full = generate(model, inputs, "greedy", **end_tokens)
    never = generate(model, inputs, "greedy", exit_threshold=1.0, **end_tokens)
    assert torch.equal(never.sequences, full.sequences)
    assert bool((generated_layers(never) == DEPTH).all())


def test_full_model_reports_full_depth_and_beam_padding_as_zero(model):
    out = generate(model, batch_of(4), "beam")
    finished_early = out.sequences[:, 1:] == model.config.pad_token_id
    assert bool((out.exit_layers[finished_early] == 0).all())
    assert bool((out.exit_layers[~finished_early] == DEPTH).all())


# --- forced exits and the cache ------------------------------------------------------------------------------------


def decode_with_cache(model, inputs, settings, steps: int = 6, exit_layers: list | None = None):
    """Greedy steps through `forward` with one cache, so its contents can be inspected; returns (tokens, cache).
    Each step's `exit_layers` output [rows] is appended to `exit_layers` when given."""
    encoder_outputs = model.get_encoder()(**inputs, exit_settings=settings)
    tokens = torch.zeros(inputs["input_ids"].shape[0], 1, dtype=torch.long)
    cache = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(
                encoder_outputs=encoder_outputs,
                attention_mask=inputs["attention_mask"],
                decoder_input_ids=tokens[:, -1:],
                past_key_values=cache,
                exit_settings=settings,
                use_cache=True,
            )
            cache = out.past_key_values
            tokens = torch.cat([tokens, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            if exit_layers is not None:
                exit_layers.append(out.exit_layers)
    return tokens, cache


def full_depth_cache(model, inputs, tokens):
    """The self-attention K/V of a teacher-forced full-depth pass over `tokens` (all but the last)."""
    with torch.no_grad():
        out = model(**inputs, decoder_input_ids=tokens[:, :-1], use_cache=True, output_hidden_states=True)
    return out.past_key_values.self_attention_cache, out.decoder_hidden_states


def test_recompute_completes_every_layer_like_a_full_depth_pass(model):
    inputs = batch_of(4)
    settings = EarlyExitSettings(decoder=mixed_exits(), kv_strategy="recompute")
    steps = []
    tokens, cache = decode_with_cache(model, inputs, settings, exit_layers=steps)
    exits = torch.stack(steps, dim=1)  # [rows, steps]
    assert set(exits.unique().tolist()) == {1, 2, 3, 4}
    # One more token at full depth catches every layer up on all earlier tokens.
    settings.decoder = None
    with torch.no_grad():
        model(
            encoder_outputs=model.get_encoder()(**inputs),
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=tokens[:, -1:],
            past_key_values=cache,
            exit_settings=settings,
        )
    reference, _ = full_depth_cache(model, inputs, tokens)
    ours = cache.self_attention_cache
    assert bool((ours.frontier == DEPTH).all())
    for layer in range(DEPTH):
        torch.testing.assert_close(ours.layers[layer].keys[:, :, :-1], reference.layers[layer].keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            ours.layers[layer].values[:, :, :-1], reference.layers[layer].values, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("stacked", [True, False])
def test_propagate_fills_skipped_layers_with_their_projections_of_the_exited_state(model, stacked, monkeypatch):
    """Filled here outside `no_grad`, as the steps were not: without grad, as they ran, stacked or layer by layer."""
    if not stacked:
        monkeypatch.setattr(modeling_ofa, "CPU_STACK_MAX_ELEMENTS", 0)
    inputs = batch_of(4)
    settings = EarlyExitSettings(decoder=FixedLayerExit(1), kv_strategy="propagate")
    tokens, cache = decode_with_cache(model, inputs, settings)
    # Every token exits after layer 1, whose output a teacher-forced pass reproduces (layer 1 always runs).
    _, states = full_depth_cache(model, inputs, tokens)
    ours = cache.self_attention_cache
    # No token ran deeper than an earlier one, so no skipped slot was read, and none was filled yet.
    assert len(ours.skipped) == 6
    assert all(not bool(ours.layers[layer].keys.any()) for layer in range(1, DEPTH))
    ours.fill_skipped()
    assert ours.skipped == []
    with torch.no_grad():
        for layer in range(1, DEPTH):
            key, value = model.decoder.layers[layer].self_key_values(states[1])
            torch.testing.assert_close(ours.layers[layer].keys, key, rtol=0, atol=1e-5)
            torch.testing.assert_close(ours.layers[layer].values, value, rtol=0, atol=1e-5)


def test_cropping_the_cache_forgets_the_skipped_slots_it_removes(model):
    settings = EarlyExitSettings(decoder=FixedLayerExit(1), kv_strategy="propagate")
    _, cache = decode_with_cache(model, batch_of(2), settings)
    ours = cache.self_attention_cache
    ours.crop(-2)
    assert [step.slots for step in ours.skipped] == [slice(position, position + 1) for position in range(4)]
    ours.fill_skipped()
    assert ours.layers[DEPTH - 1].keys.shape[2] == 4 and bool(ours.layers[DEPTH - 1].keys.abs().sum(-1).all())


def test_closing_holes_moves_each_rows_real_slots_first_after_filling_what_was_skipped(model):
    settings = EarlyExitSettings(decoder=FixedLayerExit(1), kv_strategy="propagate")
    _, cache = decode_with_cache(model, batch_of(2), settings)
    ours = cache.self_attention_cache
    ours.fill_skipped()
    filled = [(layer.keys.clone(), layer.values.clone()) for layer in ours.layers]
    _, cache = decode_with_cache(model, batch_of(2), settings)
    ours = cache.self_attention_cache
    assert ours.skipped  # recorded, not filled yet
    real = torch.tensor([[1, 0, 1, 1, 0, 1], [1, 1, 1, 0, 0, 0]])
    ours.close_holes(real)
    assert ours.skipped == [] and ours.get_seq_length() == 4
    for layer, (keys, values) in zip(ours.layers, filled, strict=True):
        for tensor, before in ((layer.keys, keys), (layer.values, values)):
            assert torch.equal(tensor[0], before[0, :, [0, 2, 3, 5]])
            assert torch.equal(tensor[1, :, :3], before[1, :, :3]) and not bool(tensor[1, :, 3].any())


def test_a_manual_loop_continues_from_a_generate_cache_as_generate_does(model):
    """The rows `generate`'s loop ended (all of them, at its last step) are its own record: a `forward` loop from
    the cache it returns decodes every row, with the exits its controller picks."""
    inputs, settings = batch_of(2), EarlyExitSettings(decoder=mixed_exits(), kv_strategy="recompute")
    kwargs = dict(exit_controller=mixed_exits(), kv_strategy="recompute", eos_token_id=2, forced_eos_token_id=None)
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=3, return_dict_in_generate=True, **kwargs)
        tokens, cache, layers = first.sequences, first.past_key_values, []
        settings.prompt_length = tokens.shape[1]  # its steps count the new tokens, as a continuing `generate`'s do
        for _ in range(3):
            mask = torch.ones_like(tokens)
            out = model(**inputs, decoder_input_ids=tokens[:, -1:], decoder_attention_mask=mask, past_key_values=cache,
                        exit_settings=settings, use_cache=True)  # fmt: skip
            cache, tokens = out.past_key_values, torch.cat([tokens, out.logits[:, -1].argmax(-1, keepdim=True)], 1)
            layers.append(out.exit_layers)
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=3, return_dict_in_generate=True, **kwargs)
        ones = torch.ones_like(first.sequences)
        continued = model.generate(**inputs, decoder_input_ids=first.sequences, decoder_attention_mask=ones,
                                   past_key_values=first.past_key_values, max_new_tokens=3,
                                   return_dict_in_generate=True, **kwargs)  # fmt: skip
    assert torch.equal(tokens, continued.sequences)
    assert torch.equal(torch.stack(layers, dim=1), continued.exit_layers)


def test_a_reset_cache_serves_weights_changed_since(model):
    inputs, kwargs = batch_of(2), dict(max_new_tokens=NEW_TOKENS, eos_token_id=None, **NO_EXIT)
    changed = tiny_model(decoder_layers=DEPTH, encoder_layers=3)
    changed.load_state_dict(model.state_dict())
    cache = new_cache(changed.config, None)
    with torch.no_grad():
        changed.generate(**inputs, past_key_values=cache, **kwargs)
        changed.decoder.self_pos_q_linear.weight.mul_(3.0)  # a weight update between calls
        cache.reset()
        assert torch.equal(
            changed.generate(**inputs, past_key_values=cache, **kwargs), changed.generate(**inputs, **kwargs)
        )


def test_a_verification_plans_each_layers_catch_up_from_one_read_of_the_cache(model):
    """A pass that runs every waiting token to the last layer (speculative mode's verification) reads where each
    slot waits once (`catch_up_plan`) and derives each layer's waiting tokens from it (`planned_inputs`): the same
    rows, slots and states as reading the cache before each layer (`pending_inputs`), for rows waiting alike (no
    gathers) and apart."""
    torch.manual_seed(0)
    heads, width, first = model.config.decoder_attention_heads, model.config.d_model, 2
    patterns = (
        [[DEPTH, DEPTH, 1, 1, 0], [DEPTH, DEPTH, 1, 1, 0]],  # every row alike: the last slots, a slice
        [[DEPTH, DEPTH, 1, 2, 0], [DEPTH, DEPTH, DEPTH, 3, 0], [DEPTH, DEPTH, 2, DEPTH, DEPTH]],  # rows apart
    )
    for pattern in patterns:
        cache = EarlyExitCache(model.config, "recompute")
        cache.open_slots(torch.zeros(len(pattern), len(pattern[0]), width), heads)
        cache.frontier[:] = torch.tensor(pattern)
        cache.pending[:] = torch.randn_like(cache.pending)
        cache.waiting_layers.update(range(DEPTH))
        plan, rows = cache.catch_up_plan(first), torch.arange(len(pattern))
        for layer in range(DEPTH):
            planned, read = cache.planned_inputs(layer, plan, first), cache.pending_inputs(layer, rows)
            assert (planned is None) == (read is None), layer
            if read is None:
                continue
            if isinstance(read[2], slice):
                assert planned[0] is None and planned[2] == read[2] and torch.equal(planned[1], read[1])
            else:
                assert torch.equal(planned[0], read[0]) and torch.equal(planned[2], read[2]), layer
                valid = read[2] >= 0
                assert torch.equal(planned[1][valid], read[1][valid])
            cache.advance(layer, read[0], read[2], read[1] + 1)


def test_the_cache_grows_in_place_and_holds_what_a_dynamic_cache_would_through_batch_operations(model):
    """A step's slots are views of a buffer with room (no copy of the whole cache per layer and step), and what the
    cache holds after crops, beam reorderings and row selections is what concatenation would hold."""
    torch.manual_seed(0)
    cache = EarlyExitCache(model.config, "recompute")
    heads, width = model.config.decoder_attention_heads, model.config.d_model
    expected = [[torch.zeros(3, heads, 0, width // heads)] * 2 for _ in range(DEPTH)]
    frontier, pending = torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0, width)

    def step(batch: int, written: int) -> None:
        nonlocal frontier, pending
        hidden = torch.randn(batch, 1, width)
        slots = cache.open_slots(hidden, heads)
        frontier = torch.cat([frontier, torch.full((batch, 1), DEPTH)], dim=1)
        pending = torch.cat([pending, torch.zeros(batch, 1, width)], dim=1)
        for layer in range(DEPTH):
            new = [torch.zeros(batch, heads, 1, width // heads) for _ in range(2)]
            if layer < written:  # the layers this step ran; the others keep empty slots
                new = [torch.randn_like(tensor) for tensor in new]
                cache.write(layer, *new, None, slots)
            expected[layer] = [
                torch.cat([old, tensor], dim=2) for old, tensor in zip(expected[layer], new, strict=True)
            ]
        for layer in range(DEPTH):
            assert torch.equal(cache.layers[layer].keys, expected[layer][0])
            assert torch.equal(cache.layers[layer].values, expected[layer][1])
        assert torch.equal(cache.frontier, frontier) and torch.equal(cache.pending, pending)

    step(3, DEPTH)
    keys = cache.layers[0].keys
    step(3, 1)
    assert cache.layers[0].keys.data_ptr() == keys.data_ptr()  # grown in place
    step(3, DEPTH)
    cache.crop(-2)  # the slots given back must come back empty, not with what they held
    expected = [[tensor[:, :, :-2] for tensor in pair] for pair in expected]
    frontier, pending = frontier[:, :-2], pending[:, :-2]
    step(3, 1)
    step(3, 1)  # grown in place again, over a slot the crop gave back
    beams = torch.tensor([2, 0, 0])
    cache.reorder_cache(beams)
    expected = [[tensor[beams] for tensor in pair] for pair in expected]
    frontier, pending = frontier[beams], pending[beams]
    step(3, 2)
    rows = torch.tensor([1, 2])
    cache.batch_select_indices(rows)
    expected = [[tensor[rows] for tensor in pair] for pair in expected]
    frontier, pending = frontier[rows], pending[rows]
    step(2, DEPTH)
    for _ in range(20):  # past the first buffer's room
        step(2, 1)


def test_copy_fills_skipped_layers_with_the_exit_layers_keys_and_values(model):
    settings = EarlyExitSettings(decoder=mixed_exits(), kv_strategy="copy", row_exit="compact")
    steps = []
    _, cache = decode_with_cache(model, batch_of(4), settings, exit_layers=steps)
    cache.self_attention_cache.fill_skipped()  # the last step's slots: no later token read them
    exits = torch.stack(steps, dim=1)  # [rows, steps]
    layers = cache.self_attention_cache.layers
    for row in range(exits.shape[0]):
        for step in range(exits.shape[1]):
            exit_layer = int(exits[row, step])
            for skipped in range(exit_layer, DEPTH):
                assert torch.equal(layers[skipped].keys[row, :, step], layers[exit_layer - 1].keys[row, :, step])
                assert torch.equal(layers[skipped].values[row, :, step], layers[exit_layer - 1].values[row, :, step])


@pytest.mark.parametrize(
    "strategy, row_exit", [*((strategy, "compact") for strategy in KV_STRATEGIES), ("recompute", "keep")]
)
def test_a_batch_gives_the_tokens_and_exit_layers_of_its_rows_run_one_by_one(model, strategy, row_exit):
    """Compacted rows never see each other. Kept rows do run deeper than their exit, which changes their cache
    (exact K/V where `propagate` / `copy` approximate), so `keep` matches batch 1 with `recompute` only."""
    inputs = batch_of(4)
    batched = generate(model, inputs, "greedy", exit_controller=mixed_exits(), kv_strategy=strategy, row_exit=row_exit)
    for row in range(4):
        real = inputs["attention_mask"][row].bool()
        single = {
            "input_ids": inputs["input_ids"][row : row + 1, real],
            "attention_mask": inputs["attention_mask"][row : row + 1, real],
            "pixel_values": inputs["pixel_values"][row : row + 1],
        }
        alone = generate(model, single, "greedy", exit_controller=mixed_exits(offset=row), kv_strategy=strategy)
        length = alone.sequences.shape[1]
        assert torch.equal(batched.sequences[row, :length], alone.sequences[0])
        assert torch.equal(batched.exit_layers[row, : length - 1], alone.exit_layers[0])


@pytest.mark.parametrize("strategy", ["propagate", "copy"])
def test_compacted_exit_layers_count_the_layer_calls_that_ran(model, strategy):
    calls: list[list[int]] = []
    hooks = [model.decoder.register_forward_pre_hook(lambda module, args: calls.append([]))]
    for layer in model.decoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda module, args: calls[-1].append(args[0].shape[0])))
    encoder_calls: list[int] = []
    for layer in model.encoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda module, args: encoder_calls.append(args[0].shape[0])))
    try:
        out = generate(
            model,
            batch_of(4),
            "greedy",
            exit_controller={"decoder": mixed_exits(), "encoder": FixedLayerExit(lambda s: s.rows % 3 + 1)},
            kv_strategy=strategy,
            row_exit="compact",
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert [sum(step) for step in calls] == out.exit_layers.sum(dim=0).tolist()
    assert out.encoder_exit_layers[:, 0].tolist() == [1, 2, 3, 1]
    assert sum(encoder_calls) == int(out.encoder_exit_layers[:, 0].sum())


def test_propagate_projects_once_per_step_whatever_the_rows(model):
    """Rows leaving at layers 1, 2 and 3 skip layers {2, 3, 4}, {3, 4} and {4}: one projection call a step, from the
    first skipped layer, not one per row and layer, so a larger batch adds no projection calls. The last step's
    slots are never read, so never projected."""
    projected: list[tuple[int, int]] = []
    original = model.decoder.skipped_key_values

    def counting(first, hidden_states, folded=None):
        key_values = original(first, hidden_states, folded)
        projected.append((first, len(key_values)))
        return key_values

    model.decoder.skipped_key_values = counting
    try:
        out = generate(
            model, batch_of(4), "greedy", exit_controller=mixed_exits(), kv_strategy="propagate", row_exit="compact"
        )
    finally:
        del model.decoder.skipped_key_values
    firsts = [min(step) for step in out.exit_layers.T.tolist()[:-1] if min(step) < DEPTH]
    assert projected == [(first, DEPTH - first) for first in firsts]


@pytest.mark.parametrize("strategy", ["propagate", "copy"])
def test_skipped_slots_are_filled_only_when_a_later_token_runs_their_layer(model, strategy, monkeypatch):
    """Tokens that stop no deeper than the ones before never read a skipped slot: nothing is projected or copied."""
    filled: list[int] = []
    fill_step = EarlyExitCache.fill_step
    monkeypatch.setattr(
        EarlyExitCache, "fill_step", lambda cache, step: (filled.append(step.shallowest), fill_step(cache, step))
    )
    shallower = FixedLayerExit(lambda state: torch.full_like(state.rows, max(1, 3 - state.step)))  # 3, 2, 1, 1, ...
    out = generate(model, batch_of(2), "greedy", exit_controller=shallower, kv_strategy=strategy)
    assert out.exit_layers[:, :3].tolist() == [[3, 2, 1]] * 2
    assert filled == []
    alternating = FixedLayerExit(lambda state: torch.full_like(state.rows, 1 + state.step % 2))  # 1, 2, 1, 2, ...
    generate(model, batch_of(2), "greedy", exit_controller=alternating, kv_strategy=strategy)
    assert filled == [1, 1, 1]  # the steps at layer 1, each read by the next step's layer 2; never those at 2


@pytest.mark.parametrize("strategy", ["propagate", "copy"])
def test_filling_skipped_slots_late_changes_no_output_under_beam_reordering(model, strategy, monkeypatch):
    """Filling each step's skipped slots at once (before the beams are reordered) gives the same beams and scores
    as filling them when read."""
    late = generate(model, batch_of(2), "beam", exit_controller=mixed_exits(), kv_strategy=strategy)
    record_skipped = EarlyExitCache.record_skipped

    def at_once(cache, *args):
        record_skipped(cache, *args)
        cache.fill_skipped()

    monkeypatch.setattr(EarlyExitCache, "record_skipped", at_once)
    eager = generate(model, batch_of(2), "beam", exit_controller=mixed_exits(), kv_strategy=strategy)
    assert torch.equal(late.sequences, eager.sequences)
    assert torch.equal(late.exit_layers, eager.exit_layers)
    for ours, theirs in zip(late.scores, eager.scores, strict=True):  # rows projected in other groupings: rounding
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_propagate_folds_once_per_call_and_only_when_a_later_token_reads_a_skipped_layer(model, monkeypatch):
    """Folding copies every layer's projections: a call pays for it at its first fill, and a call with none never."""
    folds: list[int] = []
    fold = OFADecoder.folded_key_value_projections
    monkeypatch.setattr(OFADecoder, "folded_key_value_projections", lambda decoder: folds.append(1) or fold(decoder))
    shallower = FixedLayerExit(lambda state: torch.full_like(state.rows, max(1, 3 - state.step)))  # 3, 2, 1, 1, ...
    generate(model, batch_of(2), "greedy", exit_controller=shallower, kv_strategy="propagate")
    assert folds == []
    alternating = FixedLayerExit(lambda state: torch.full_like(state.rows, 1 + state.step % 2))  # 1, 2, 1, 2, ...
    generate(model, batch_of(2), "greedy", exit_controller=alternating, kv_strategy="propagate")
    assert folds == [1]  # three fills, one fold


def test_projections_too_large_to_stack_on_a_cpu_run_layer_by_layer_with_the_same_outputs(model, monkeypatch):
    """Past `CPU_STACK_MAX_ELEMENTS` the cross-attention K/V and `propagate`'s fills are projected layer by layer:
    the same tokens, and scores within rounding, for the full model and for exits."""
    inputs = batch_of(4)
    runs = {"full": {}, "exits": dict(exit_controller=mixed_exits(), kv_strategy="propagate")}
    stacked = {name: generate(model, inputs, "greedy", **knobs) for name, knobs in runs.items()}
    monkeypatch.setattr(modeling_ofa, "CPU_STACK_MAX_ELEMENTS", 0)
    assert model.decoder.folded_key_value_projections() is None
    assert model.decoder.cross_key_value_projections() is None
    for name, knobs in runs.items():
        out = generate(model, inputs, "greedy", **knobs)
        assert torch.equal(out.sequences, stacked[name].sequences), name
        assert torch.equal(out.exit_layers, stacked[name].exit_layers), name
        for ours, theirs in zip(out.scores, stacked[name].scores, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_propagate_folds_each_layers_layer_norm_into_its_projections(model):
    assert model.decoder.folded_key_value_projections() is not None  # the tiny model's weights are stacked
    states = torch.randn(3, 2, model.config.d_model, generator=torch.Generator().manual_seed(0))
    norm = model.decoder.layers[2].self_attn_layer_norm
    with torch.no_grad():
        norm.weight.mul_(2.0), norm.bias.add_(0.5)  # an affine that is not the identity
        folded = model.decoder.skipped_key_values(1, states, model.decoder.folded_key_value_projections)
        expected = model.decoder.skipped_key_values(1, states)
        norm.weight.div_(2.0), norm.bias.sub_(0.5)
    assert len(folded) == len(expected) == DEPTH - 1
    for (key, value), (expected_key, expected_value) in zip(folded, expected, strict=True):
        torch.testing.assert_close(key, expected_key, rtol=0, atol=1e-5)
        torch.testing.assert_close(value, expected_value, rtol=0, atol=1e-5)


# --- what ready rows do at batch > 1: kept in the batch or compacted out, and the batch-level rules -------------------


def layer_calls(model, run) -> tuple[object, list[list[int]], list[int]]:
    """`run()`'s output, the rows of each decoder layer call per decoder forward, and of each encoder layer call."""
    decoder_calls: list[list[int]] = []
    encoder_calls: list[int] = []
    hooks = [model.decoder.register_forward_pre_hook(lambda module, args: decoder_calls.append([]))]
    for layer in model.decoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda module, args: decoder_calls[-1].append(args[0].shape[0])))
    for layer in model.encoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda module, args: encoder_calls.append(args[0].shape[0])))
    try:
        return run(), decoder_calls, encoder_calls
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_keep_and_compact_give_the_same_tokens_with_exact_keys_and_values(model, mode):
    """With `recompute` every K/V is exact either way, so where ready rows go changes nothing they output."""
    inputs = batch_of(4)
    outs = {
        row_exit: generate(
            model, inputs, mode, exit_controller=mixed_exits(), kv_strategy="recompute", row_exit=row_exit
        )
        for row_exit in ("keep", "compact")
    }
    assert torch.equal(outs["keep"].sequences, outs["compact"].sequences)
    assert torch.equal(outs["keep"].exit_layers, outs["compact"].exit_layers)
    for kept, compacted in zip(outs["keep"].scores, outs["compact"].scores, strict=True):
        torch.testing.assert_close(kept, compacted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_keep_and_compact_agree_on_random_combinations(model, seed):
    """The same invariant over features combined at random: batch and padding, greedy or beams with several
    returned sequences, rows that end apart, encoder exits, `min_exit_layer`, and exits keyed by row and step."""
    rng = random.Random(seed)
    inputs = tiny_inputs(batch=rng.randint(1, 5), text_length=rng.randint(4, 9), seed=seed, pad_last=rng.randint(0, 3))
    beams = rng.choice([1, 2, 3])
    options = {"max_new_tokens": rng.randint(1, 10), "num_beams": beams, "num_return_sequences": rng.randint(1, beams)}
    if rng.random() < 0.5:
        options["eos_token_id"] = emitted_token(model, inputs, rng, new_tokens=5)
    controllers = {"decoder": mixed_exits(offset=rng.randint(0, DEPTH - 1))}
    if rng.random() < 0.5:
        shift = rng.randint(0, 2)
        controllers["encoder"] = FixedLayerExit(lambda state: (state.rows + shift) % 3 + 1)
    knobs = dict(exit_controller=controllers, kv_strategy="recompute", min_exit_layer=rng.randint(1, DEPTH - 1))
    with torch.no_grad():
        keep, compact = (
            model.generate(**inputs, **options, **knobs, row_exit=plan, do_sample=False, return_dict_in_generate=True)
            for plan in ("keep", "compact")
        )
    assert torch.equal(keep.sequences, compact.sequences), options
    assert torch.equal(keep.exit_layers, compact.exit_layers)
    assert torch.equal(keep.encoder_exit_layers, compact.encoder_exit_layers)


def test_kept_rows_run_as_deep_as_the_batch_and_compacted_rows_stop(model):
    controllers = {"decoder": mixed_exits(), "encoder": FixedLayerExit(lambda s: s.rows % 3 + 1)}
    for row_exit in ("keep", "compact"):
        out, calls, encoder_calls = layer_calls(
            model, lambda r=row_exit: generate(model, batch_of(4), "greedy", exit_controller=controllers, row_exit=r)
        )
        deepest = out.exit_layers.max(dim=0).values.tolist()
        if row_exit == "keep":  # every layer call runs the whole batch, until the deepest row of the step
            assert calls == [[4] * depth for depth in deepest]
            assert encoder_calls == [4] * int(out.encoder_exit_layers[:, 0].max())
        else:
            assert [sum(step) for step in calls] == out.exit_layers.sum(dim=0).tolist()
            assert sum(encoder_calls) == int(out.encoder_exit_layers[:, 0].sum())
        assert out.encoder_exit_layers[:, 0].tolist() == [1, 2, 3, 1]  # each row's output is its own exit's


def exits_once(row: int, step: int, layer: int) -> FixedLayerExit:
    """Row `row` is ready after `layer` at decoding step `step`; every other row and step runs in full."""
    return FixedLayerExit(lambda s: torch.where((s.rows == row) & (s.step == step), layer, DEPTH))


@pytest.mark.parametrize("strategy", ["propagate", "copy"])
def test_kept_rows_get_the_exact_keys_and_values_of_the_layers_the_batch_ran(model, strategy):
    """Row 1 is ready after layer 1 at step 2 while the others run on: kept, it has in every layer the K/V of a
    full-depth teacher-forced pass of its tokens; compacted, the layers it skipped hold the strategy's
    approximation, and only there do the two differ (the later tokens attend to it, so they are compared on the
    cache, not on the tokens)."""
    inputs = batch_of(4)
    caches = {}
    for row_exit in ("keep", "compact"):
        settings = EarlyExitSettings(decoder=exits_once(1, 2, 1), kv_strategy=strategy, row_exit=row_exit)
        tokens, cache = decode_with_cache(model, inputs, settings, steps=5)
        caches[row_exit] = cache.self_attention_cache
        caches[row_exit].fill_skipped()
        expected, _ = full_depth_cache(model, inputs, tokens)
        for layer in range(DEPTH):
            ours, theirs = caches[row_exit].layers[layer].keys, expected.layers[layer].keys
            # propagate's first skipped layer is exact (its input is the exited state); copy's is not.
            approximated = row_exit == "compact" and layer >= (2 if strategy == "propagate" else 1)
            exact = torch.ones(ours.shape[0], ours.shape[2], dtype=torch.bool)
            if row_exit == "compact":  # row 1's later tokens attend to the approximated slot
                exact[1, 2:] = False
            torch.testing.assert_close(ours.transpose(1, 2)[exact], theirs.transpose(1, 2)[exact], rtol=0, atol=1e-5)
            assert approximated != torch.allclose(ours[1, :, 2], theirs[1, :, 2], atol=1e-3)


def test_tokens_from_the_batch_layer_are_the_full_models_when_a_row_runs_in_full(model):
    """Each step of `mixed_exits` has a row that runs all the layers, so every token taken from the layer where the
    batch stops is the full model's."""
    inputs = batch_of(4)
    full = generate(model, inputs, "greedy")
    batch_layer = generate(model, inputs, "greedy", exit_controller=mixed_exits(), exit_token_layer="batch")
    own = generate(model, inputs, "greedy", exit_controller=mixed_exits())
    assert torch.equal(batch_layer.sequences, full.sequences)
    assert bool((batch_layer.exit_layers[batch_layer.exit_layers > 0] == DEPTH).all())
    assert not torch.equal(own.exit_layers, batch_layer.exit_layers)


def test_a_batch_stops_once_the_fraction_of_ready_rows_is_reached(model):
    """`mixed_exits` readies one row in four after each layer: at half, every step stops after layer 2."""
    inputs = batch_of(4)
    out, calls, _ = layer_calls(
        model,
        lambda: generate(model, inputs, "greedy", exit_controller=mixed_exits(), batch_stop_fraction=0.5),
    )
    own = generate(model, inputs, "greedy", exit_controller=mixed_exits(), row_exit="keep").exit_layers
    assert torch.equal(out.exit_layers[:, 0], own[:, 0].clamp(max=2))
    assert all(len(step) == 2 for step in calls)


def test_auto_follows_the_measured_layer_costs(model):
    """`row_exit="auto"` compacts where the layer costs say removing rows pays and keeps rows elsewhere; the costs
    are measured once per shape and kept on the model."""
    inputs = batch_of(4)
    model.decoder.measured_layer_costs.clear()
    generate(model, inputs, "greedy", exit_controller=mixed_exits())
    (key,) = model.decoder.measured_layer_costs  # one decoding shape: measured once
    assert key[:2] == (4, 1)
    runs = {}
    for name, table in (
        ("pays", LayerCosts(rows=(1, 4), kept=(1.0, 10.0), compacted=(1.0, 2.0), gather=0.0)),
        ("never", LayerCosts(rows=(1, 4), kept=(1.0, 1.0), compacted=(5.0, 5.0), gather=1.0)),
    ):
        model.decoder.measured_layer_costs[key] = table
        runs[name] = layer_calls(model, lambda: generate(model, inputs, "greedy", exit_controller=mixed_exits()))
    model.decoder.measured_layer_costs.clear()
    out, calls, _ = runs["pays"]
    assert [sum(step) for step in calls] == out.exit_layers.sum(dim=0).tolist()
    out, calls, _ = runs["never"]
    assert calls == [[4] * depth for depth in out.exit_layers.max(dim=0).values.tolist()]


def test_rows_the_loop_ended_stop_at_the_first_exit_from_then_on(model):
    """`generate` feeds a row its stopping criteria ended its last token, then the pad token, and drops its tokens:
    from then on it must not keep its batch running. A speculative round feeds the pad token to the rows that do not
    draft."""
    inputs = batch_of(4)
    pad = model.config.pad_token_id
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
        for row_exit in ("keep", "compact"):
            settings = EarlyExitSettings(decoder=NeverExit(), row_exit=row_exit, min_exit_layer=2)
            cache = new_cache(model.config, settings)
            layers = []
            # Fed tokens, and the rows the loop's stopping check ended after the step (row 2, then row 3).
            for step, ended in (
                ([7, 7, 7, 7], 2),
                ([5, pad, 7, 9], 3),
                ([6, 8, pad, 7], None),
                ([pad, 8, pad, pad], None),
            ):
                out = model.decoder(torch.tensor(step)[:, None], encoder_outputs, past_key_values=cache,
                                    exit_settings=settings)  # fmt: skip
                layers.append(out.exit_layers.tolist())
                if ended is not None:
                    cache.self_attention_cache.end_rows(torch.arange(4) == ended)
            # A row fed the pad token or an end token that no stopping check ended it runs on.
            assert layers == [[DEPTH] * 4, [DEPTH, DEPTH, 2, DEPTH], [DEPTH, DEPTH, 2, 2], [DEPTH, DEPTH, 2, 2]], (
                row_exit
            )
        # Outside greedy and sampling's loop (beam search, a plain forward) no row is finished.
        tokens = torch.tensor([[5], [pad], [7], [9]])
        out = model.decoder(tokens, encoder_outputs, exit_settings=EarlyExitSettings(decoder=NeverExit()))
        assert out.exit_layers.tolist() == [DEPTH] * 4
        drafting = EarlyExitSettings(decoder=NeverExit(), min_exit_layer=2, exit_mode="speculative")
        assert model.decoder(tokens, encoder_outputs, exit_settings=drafting).exit_layers.tolist() == [
            DEPTH,
            2,
            DEPTH,
            DEPTH,
        ]
        prompt = torch.tensor([[0, pad], [0, 5], [0, 6], [0, 7]])
        out = model.decoder(prompt, encoder_outputs, exit_settings=drafting)
        assert out.exit_layers.tolist() == [DEPTH] * 4


class PadFirst(LogitsProcessor):
    """Row 0 emits the pad token as its first new token: a running row, whatever the token."""

    def __init__(self, pad: int):
        self.pad = pad

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == 1:
            scores = scores.clone()
            scores[0] = -1e9
            scores[0, self.pad] = 0.0
        return scores


@pytest.mark.parametrize("row_exit", ["keep", "compact"])
def test_a_running_row_that_emits_the_pad_token_decodes_like_the_full_model(model, row_exit):
    inputs = batch_of(2)
    processors = LogitsProcessorList([PadFirst(model.config.pad_token_id)])
    full = generate(model, inputs, "greedy", logits_processor=processors, **NO_EXIT)
    out = generate(model, inputs, "greedy", logits_processor=processors, exit_controller=NeverExit(), row_exit=row_exit)
    assert int(full.sequences[0, 1]) == model.config.pad_token_id
    assert torch.equal(out.sequences, full.sequences) and bool((out.exit_layers == DEPTH).all())


def test_finished_rows_do_not_count_toward_the_batch_stop_fraction(model):
    """Rows that have ended are ready at the first exit; the fraction counts the rows still decoding, so two live
    rows of four whose neighbours ended do not stop each other."""
    inputs = batch_of(4)
    full = generate(model, inputs, "greedy", **NO_EXIT)
    end = int(full.sequences[0, 1])  # row 0's first token: its end, and that of rows that start alike
    ended_early = full.sequences[:, 1] == end
    assert 0 < int(ended_early.sum()) < 4
    out = generate(model, inputs, "greedy", exit_controller=NeverExit(), batch_stop_fraction=0.5, eos_token_id=end)
    assert torch.equal(out.sequences, generate(model, inputs, "greedy", eos_token_id=end, **NO_EXIT).sequences)
    assert bool((out.exit_layers[~ended_early, :3] == DEPTH).all())


def test_a_row_that_just_emitted_its_end_token_keeps_its_tokens_and_reports_no_layers_past_it(model):
    """Its later steps stop at the first exit (`test_rows_the_loop_ended_stop_at_the_first_exit_from_then_on`);
    `generate` reports 0 layers for them, as for any token past a row's end."""
    inputs = batch_of(4)
    full = generate(model, inputs, "greedy", **NO_EXIT)
    end = int(full.sequences[:, 3].mode().values)  # a token some rows emit early: their end
    ended = full.sequences[:, 1:] == end
    assert 0 < int(ended.any(dim=1).sum()) < 4
    out = generate(model, inputs, "greedy", exit_controller=NeverExit(), min_exit_layer=2, eos_token_id=end)
    assert torch.equal(out.sequences, generate(model, inputs, "greedy", eos_token_id=end, **NO_EXIT).sequences)
    for row, layers in enumerate(out.exit_layers.tolist()):
        first_end = ended[row].nonzero()[0].item() if bool(ended[row].any()) else None
        if first_end is not None and first_end + 1 < len(layers):
            assert layers[: first_end + 1] == [DEPTH] * (first_end + 1) and set(layers[first_end + 1 :]) == {0}, row


class EndsRowZero(StoppingCriteria):
    """A user's criterion: row 0 ends after 3 new tokens."""

    def __call__(self, input_ids, scores, **kwargs):
        return (torch.arange(input_ids.shape[0]) == 0) & (input_ids.shape[1] >= 4)


@pytest.mark.parametrize("mode", ["full", "exits", "speculative"])
def test_a_row_a_users_stopping_criterion_ends_reports_no_layers_past_it_and_stops_holding_the_batch(model, mode):
    knobs = {
        "full": NO_EXIT,
        "exits": dict(exit_controller=NeverExit(), min_exit_layer=2, row_exit="compact"),
        "speculative": dict(exit_controller=FixedLayerExit(1), exit_mode="speculative"),
    }[mode]
    rows_in_last_layer = []
    hook = model.decoder.layers[-1].register_forward_pre_hook(
        lambda module, args: rows_in_last_layer.append(args[0].shape[0])
    )
    try:
        criteria = StoppingCriteriaList([EndsRowZero()])
        out = generate(model, batch_of(4), "greedy", stopping_criteria=criteria, **knobs)
    finally:
        hook.remove()
    full = generate(model, batch_of(4), "greedy", stopping_criteria=criteria, **NO_EXIT)
    assert torch.equal(out.sequences, full.sequences)
    assert bool((out.exit_layers[0, :3] > 0).all()) and set(out.exit_layers[0, 3:].tolist()) == {0}
    assert bool((out.exit_layers[1:] > 0).all())
    if mode == "exits":  # from the step after its end on, row 0 stops at the first exit
        assert rows_in_last_layer == [4] * 3 + [3] * (NEW_TOKENS - 3)


def test_without_an_end_token_a_row_a_criterion_ended_decodes_on_as_in_the_full_model(model):
    """Transformers pads ended rows only when the call has an end token; without one it keeps their tokens."""
    criteria = StoppingCriteriaList([EndsRowZero()])
    full = generate(model, batch_of(4), "greedy", stopping_criteria=criteria, eos_token_id=None, **NO_EXIT)
    exits = dict(exit_controller=NeverExit(), min_exit_layer=2, row_exit="compact")
    out = generate(model, batch_of(4), "greedy", stopping_criteria=criteria, eos_token_id=None, **exits)
    assert torch.equal(out.sequences, full.sequences) and bool((out.exit_layers == DEPTH).all())
    speculative = dict(exit_controller=FixedLayerExit(1), exit_mode="speculative")
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, batch_of(4), "greedy", stopping_criteria=criteria, eos_token_id=None, **speculative)


def test_min_exit_layer_holds_back_exits(model):
    out = generate(model, batch_of(4), "greedy", exit_controller=FixedLayerExit(1), min_exit_layer=3)
    assert bool((out.exit_layers == 3).all())


def test_max_exit_layer_stops_asking_and_runs_the_rest_in_full(model):
    asked = []

    class Recorder(ExitController):
        def __call__(self, state):  # ready only from layer 3 on: after max_exit_layer=2, never asked there
            asked.append(state.layer)
            return torch.full((state.rows.shape[0],), state.layer >= 3)

    inputs = batch_of(4)
    bounded = generate(model, inputs, "greedy", exit_controller=Recorder(), max_exit_layer=2)
    assert set(asked) == {1, 2}
    full = generate(model, inputs, "greedy", **NO_EXIT)
    assert torch.equal(bounded.sequences, full.sequences)  # no row was ready by layer 2: the full model's tokens
    assert bool((bounded.exit_layers[bounded.exit_layers > 0] == DEPTH).all())
    early = generate(model, inputs, "greedy", exit_controller=FixedLayerExit(1), min_exit_layer=2, max_exit_layer=2)
    assert bool((early.exit_layers[early.exit_layers > 0] == 2).all())
    # A saved default; speculative mode, whose drafts are its own, refuses it.
    assert EarlyExitSettings.from_knobs(tiny_config(decoder_layers=DEPTH, max_exit_layer=3)).max_exit_layer == 3
    with pytest.raises(ValueError, match="max_exit_layer"):
        model.generate(**inputs, max_new_tokens=3, exit_threshold=0.5, exit_mode="speculative", max_exit_layer=2)


def test_confidence_exit_at_a_low_threshold_stops_at_the_first_allowed_layer(model):
    out = generate(model, batch_of(2), "beam", exit_policy="confidence", exit_threshold=0.0, min_exit_layer=2)
    assert bool((out.exit_layers[out.exit_layers > 0] == 2).all())
    # The exited tokens are the ones a 2-layer model picks: the shared head on layer 2's state.
    patience = generate(model, batch_of(2), "greedy", exit_policy="patience", exit_threshold=2)
    assert bool((patience.exit_layers >= 2).all())


@pytest.mark.parametrize("decoding", ["greedy", "beam"])
def test_the_fixed_layer_policy_exits_every_token_after_its_layer(model, decoding):
    fixed = generate(model, batch_of(2), decoding, exit_policy="fixed_layer", exit_threshold=2)
    forced = generate(model, batch_of(2), decoding, exit_controller=FixedLayerExit(2))
    assert torch.equal(fixed.sequences, forced.sequences)
    assert set(fixed.exit_layers[fixed.exit_layers > 0].tolist()) == {2}
    # From the first exit point at or above the layer asked: here layer 2, the first `min_exit_layer` allows.
    assert set(generate(model, batch_of(2), decoding, exit_policy="fixed_layer", exit_threshold=1, min_exit_layer=2)
               .exit_layers.unique().tolist()) <= {0, 2}  # fmt: skip


def test_a_step_that_stops_at_one_exit_reuses_the_exit_heads_logits(model):
    inputs = batch_of(2)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
        start = torch.zeros(2, 1, dtype=torch.long)
        asked = model.decoder(start, encoder_outputs, exit_settings=EarlyExitSettings(decoder=ConfidenceExit(0.0)))
        forced = model.decoder(start, encoder_outputs, exit_settings=EarlyExitSettings(decoder=FixedLayerExit(1)))
    assert forced.logits is None  # no controller asked for the exit head
    torch.testing.assert_close(
        asked.logits, model.decoder.output_projection(asked.last_hidden_state), rtol=0, atol=1e-6
    )
    # In generate, the reused logits give what projecting the exit state gives.
    confident = generate(model, inputs, "greedy", exit_policy="confidence", exit_threshold=0.0, min_exit_layer=2)
    fixed = generate(model, inputs, "greedy", exit_controller=FixedLayerExit(2))
    assert torch.equal(confident.sequences, fixed.sequences)
    margin = generate(model, inputs, "greedy", exit_policy="margin", exit_threshold=0.0, min_exit_layer=2)
    assert torch.equal(margin.sequences, fixed.sequences)
    for reused, projected in zip(confident.scores, fixed.scores, strict=True):
        torch.testing.assert_close(reused, projected, rtol=0, atol=1e-6)


def test_teacher_forced_forward_with_exits_uses_each_rows_exit_state(model):
    inputs = batch_of(2)
    decoder_input_ids = torch.tensor([[0, 5, 9, 14], [0, 7, 7, 30]])
    settings = EarlyExitSettings(decoder=FixedLayerExit(lambda s: s.rows + 1))
    with torch.no_grad():
        exited = model(**inputs, decoder_input_ids=decoder_input_ids, exit_settings=settings, use_cache=False)
        full = model(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False, output_hidden_states=True)
    for row in range(2):
        expected = model.decoder.exit_logits(full.decoder_hidden_states[row + 1][row])
        torch.testing.assert_close(exited.logits[row], expected, rtol=0, atol=1e-5)
    assert exited.exit_layers.tolist() == [1, 2]


class DeviceReads(TorchDispatchMode):
    """Counts what the host reads of tensors (each a sync on a GPU): `item`/`bool`/`int`, `nonzero`, an index by a
    mask, and `tolist` (which reads a CPU tensor's memory without an op)."""

    reads_ops = {"_local_scalar_dense", "nonzero", "masked_select"}

    def __init__(self, monkeypatch):
        super().__init__()
        self.counting, self.reads = False, 0
        tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: (self.count(), tolist(tensor))[1])

    def count(self) -> None:
        self.reads += self.counting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        indices = args[1] if name.startswith(("index", "_index_put")) and len(args) > 1 else ()
        if name in self.reads_ops or any(getattr(index, "dtype", None) == torch.bool for index in indices):
            self.count()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("row_exit", "strategy"),
    [("keep", "propagate"), ("keep", "recompute"), ("compact", "propagate"), ("compact", "copy")],
)
def test_a_decoding_step_reads_the_device_only_for_its_exit_questions(model, row_exit, strategy, monkeypatch):
    """A GPU stalls at each read: the decoder reads each exit question's answer once, and nothing else, while rows
    stop at scattered layers (batch 4, padded). Recompute's catch-ups under compaction read their shapes."""
    questions, reads = [], DeviceReads(monkeypatch)
    decoder_forward, stop = OFADecoder.forward, RowExits.stop

    def counted_forward(*args, **kwargs):
        reads.counting = True
        try:
            return decoder_forward(*args, **kwargs)
        finally:
            reads.counting = False

    monkeypatch.setattr(OFADecoder, "forward", counted_forward)
    monkeypatch.setattr(RowExits, "stop", lambda exits, *args: (questions.append(1), stop(exits, *args))[1])
    with reads:
        out = generate(model, batch_of(4), "greedy", exit_controller=mixed_exits(), kv_strategy=strategy,
                       row_exit=row_exit)  # fmt: skip
    assert len(set(generated_layers(out).tolist())) > 2  # scattered
    assert reads.reads == len(questions) > 0


# --- encoder exits ---------------------------------------------------------------------------------------------------


def test_decomposed_encoder_streams_exit_on_their_own_per_row():
    model = tiny_model(encoder_layers=3, decompose_encoder_modalities=True)
    inputs = batch_of(2)
    controllers = {"encoder_image": FixedLayerExit(lambda s: s.rows + 1), "encoder_text": FixedLayerExit(2)}
    settings = EarlyExitSettings(**controllers)
    with torch.no_grad():
        exited = model.get_encoder()(**inputs, exit_settings=settings)
        full = model.get_encoder()(**inputs, output_hidden_states=True)
    assert exited.exit_layers.tolist() == [[1, 2], [2, 2]]
    num_image = full.last_hidden_state.shape[1] - inputs["input_ids"].shape[1]
    for row, image_layer in enumerate((1, 2)):
        expected = torch.cat(
            [full.hidden_states[image_layer][row, :num_image], full.hidden_states[2][row, num_image:]], dim=0
        )
        torch.testing.assert_close(exited.last_hidden_state[row], model.encoder.layer_norm(expected), rtol=0, atol=1e-5)
    out = model.generate(
        **inputs, max_new_tokens=3, encoder_image_exit_threshold=-1.0, return_dict_in_generate=True
    )  # any similarity is above -1: both rows stop the image stream after its first layer
    assert out.encoder_exit_layers.tolist() == [[1, 3], [1, 3]]


def test_encoder_min_exit_layer_skips_the_tests_below_it():
    model = tiny_model(encoder_layers=4, decompose_encoder_modalities=True)
    asked = []

    def always(state):
        asked.append((state.part, state.layer))
        return torch.ones_like(state.rows, dtype=torch.bool)

    settings = EarlyExitSettings(encoder_image=always, encoder_text=always, encoder_min_exit_layer=3)
    with torch.no_grad():
        exited = model.get_encoder()(**batch_of(2), exit_settings=settings)
    assert exited.exit_layers.tolist() == [[3, 3], [3, 3]]
    assert asked == [("encoder_image", 3), ("encoder_text", 3)]
    out = model.generate(
        **batch_of(2), max_new_tokens=3, encoder_text_exit_threshold=-1.0, encoder_min_exit_layer=2,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.encoder_exit_layers.tolist() == [[4, 2], [4, 2]]


# --- knobs, defaults and bad input ----------------------------------------------------------------------------------


def test_defaults_come_from_the_config_and_the_generation_config_and_survive_save_load(tmp_path):
    model = tiny_model(decoder_layers=DEPTH, exit_threshold=-1.0, min_exit_layer=2)
    inputs = batch_of(2)
    assert bool((generated_layers(generate(model, inputs, "greedy")) == 2).all())
    assert bool((generate(model, inputs, "greedy", exit_threshold=None).exit_layers == DEPTH).all())
    model.generation_config.min_exit_layer = 3
    assert bool((generated_layers(generate(model, inputs, "greedy")) == 3).all())
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert reloaded.config.exit_threshold == -1.0
    assert reloaded.generation_config.min_exit_layer == 3
    assert bool((generated_layers(generate(reloaded, inputs, "greedy")) == 3).all())
    explicit = GenerationConfig(min_exit_layer=4, max_new_tokens=3)
    assert bool(
        (reloaded.generate(**inputs, generation_config=explicit, return_dict_in_generate=True).exit_layers == 4).all()
    )
    # A knob a passed config holds is the call's own, None ("no exit") included: it is not completed from the saved.
    reloaded.generation_config.exit_threshold = -1.0
    for full in (GenerationConfig(exit_threshold=None, max_new_tokens=3), GenerationConfig(**NO_EXIT)):
        out = reloaded.generate(**inputs, generation_config=full, max_new_tokens=3, return_dict_in_generate=True)
        assert bool((out.exit_layers == DEPTH).all())


def test_a_model_config_knob_the_generation_config_outranks_is_said_once(monkeypatch):
    from hf_earlyexit.modeling import exit_knobs

    model, said = tiny_model(decoder_layers=DEPTH, exit_threshold=-1.0), []
    monkeypatch.setattr(exit_knobs.logger, "warning_once", said.append)
    generate(model, batch_of(1), "greedy")
    model.generation_config.exit_threshold = 0.5  # what a calibration writes
    generate(model, batch_of(1), "greedy")
    assert len(said) == 1 and "`exit_threshold=-1.0` in the model config is outranked" in said[0]


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(exit_treshold=0.9), "exit_treshold"),
        (dict(exit_threshold=1.5), "exit_threshold"),
        (dict(exit_threshold=-0.1, exit_policy="confidence"), "exit_threshold"),
        (dict(exit_threshold="high"), "exit_threshold"),
        (dict(exit_threshold=0.9, exit_policy="entropic"), "exit_policy"),
        (dict(exit_threshold=0.9, exit_threshold_schedule="cosine"), "exit_threshold_schedule"),
        (dict(exit_threshold=2.5, exit_policy="patience"), "layer count"),
        (dict(exit_threshold=100, exit_policy="patience"), "so it would never exit"),  # was accepted, never exiting
        (dict(exit_threshold=torch.tensor(9), exit_policy="patience"), "so it would never exit"),
        (dict(exit_threshold=DEPTH - 1, exit_policy="patience", min_exit_layer=2), "asks 2 "),  # layers 2, 3 asked
        (dict(exit_mode="speculative", exit_policy="patience", exit_threshold=2, draft_exit_threshold=9), "draft_exit"),
        (dict(exit_threshold=DEPTH, exit_policy="fixed_layer"), "up to layer 3 .* so it would never exit"),
        (dict(exit_threshold=2, exit_policy="fixed_layer", max_exit_layer=1), "up to layer 1"),
        (dict(exit_mode="speculative", draft_exit_policy="fixed_layer", draft_exit_threshold=0.5), "draft_exit"),
        (dict(kv_strategy="share"), "kv_strategy"),
        (dict(min_exit_layer=0), "min_exit_layer"),
        (dict(min_exit_layer=DEPTH + 1), "min_exit_layer"),
        (dict(max_exit_layer=0), "max_exit_layer"),
        (dict(max_exit_layer=DEPTH + 1), "max_exit_layer"),
        (dict(max_exit_layer=2.0), "max_exit_layer"),
        (dict(min_exit_layer=3, max_exit_layer=2), "max_exit_layer"),
        (dict(encoder_min_exit_layer=0), "encoder_min_exit_layer"),
        (dict(encoder_min_exit_layer=2.0), "encoder_min_exit_layer"),
        (dict(encoder_exit_threshold=1.2), "encoder_exit_threshold"),
        (dict(encoder_image_exit_threshold=0.9), "decompose_encoder_modalities"),
        (dict(exit_controller={"decodr": FixedLayerExit(1)}), "decodr"),
        (dict(exit_controller=0.9), "callable"),
        (dict(exit_controller=lambda state: torch.ones(1, dtype=torch.bool)), "shape"),
        (dict(exit_threshold=0.9, use_cache=False), "use_cache"),
        (dict(exit_threshold=0.9, kv_strategy="recompute", cache_implementation="static"), "static"),
        (dict(row_exit="fast"), "row_exit"),
        (dict(exit_token_layer="deepest"), "exit_token_layer"),
        (dict(exit_token_layer="batch", row_exit="compact"), "row_exit"),
        (dict(batch_stop_fraction=0), "batch_stop_fraction"),
        (dict(batch_stop_fraction=1.5), "batch_stop_fraction"),
        (dict(batch_stop_fraction="half"), "batch_stop_fraction"),
    ],
)
def test_bad_knobs_raise_value_errors_naming_them(model, knobs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(**batch_of(4), max_new_tokens=3, **knobs)


def test_knobs_given_as_numpy_scalars_act_as_python_numbers(model):
    """Values read from arrays (a sweep's `np.linspace`, a data frame) are numbers too."""
    knobs = dict(exit_threshold=0.5, exit_policy="confidence", min_exit_layer=2, max_exit_layer=3)
    as_numpy = dict(knobs, exit_threshold=np.float32(0.5), min_exit_layer=np.int64(2), max_exit_layer=np.int32(3))
    outputs = [
        model.generate(**batch_of(4), max_new_tokens=4, return_dict_in_generate=True, batch_stop_fraction=fraction, **k)
        for k, fraction in ((knobs, 1.0), (as_numpy, np.float64(1.0)))
    ]
    assert torch.equal(outputs[0].sequences, outputs[1].sequences)
    assert torch.equal(outputs[0].exit_layers, outputs[1].exit_layers)
    assert set(outputs[1].exit_layers.unique().tolist()) <= {0, 2, 3, DEPTH}
    fixed = model.generate(**batch_of(2), max_new_tokens=3, exit_controller=FixedLayerExit(np.int64(2)))
    patient = model.generate(**batch_of(2), max_new_tokens=3, exit_policy="patience", exit_threshold=np.int64(2))
    drafted = model.generate(
        **batch_of(2), max_new_tokens=3, exit_mode="speculative", exit_threshold=0.5, num_assistant_tokens=np.int64(2)
    )
    assert fixed.shape[0] == patient.shape[0] == drafted.shape[0] == 2


def test_reports_show_a_draft_vocabulary_by_its_size():
    from hf_earlyexit.modeling.exit_knobs import shown_knobs

    knobs = {"exit_mode": "speculative", "draft_vocabulary": list(range(3, 4099))}
    assert shown_knobs(knobs) == {"exit_mode": "speculative", "draft_vocabulary": "4096 token ids"}
    assert shown_knobs({"exit_threshold": 0.5}) == {"exit_threshold": 0.5}


def test_bad_config_defaults_are_refused():
    with pytest.raises(ValueError, match="kv_strategy"):
        tiny_model(kv_strategy="share")
    with pytest.raises(ValueError, match="min_exit_layer"):
        tiny_model(min_exit_layer=9)
    with pytest.raises(ValueError, match="draft_vocabulary"):
        tiny_model(draft_vocabulary=[3, 120])  # the tiny vocabulary ends at 119
    # A threshold that is no number was saved; a wrong type was `@strict`'s own exception, not a ValueError.
    for fields, message in (
        ({"exit_threshold": float("nan")}, "`exit_threshold` must be finite"),
        ({"min_exit_layer": 2.0}, "Config field `min_exit_layer`: .*expected int, got float"),
        ({"batch_stop_fraction": "0.5"}, "Config field `batch_stop_fraction`"),
    ):
        with pytest.raises(ValueError, match=message):
            tiny_model(**fields)
    # Its policy's range is checked on what a call runs with: a generation config may set another policy.
    for fields, message in (
        ({"exit_threshold": -0.5, "exit_policy": "confidence"}, "confidence score's threshold"),
        ({"exit_threshold": 0.5, "exit_policy": "patience"}, "patience policy is one layer count"),
    ):
        with pytest.raises(ValueError, match=message):
            tiny_model(**fields).generate(**tiny_inputs(), max_new_tokens=2)


def test_saved_thresholds_out_of_their_policys_range_are_not_saved_and_others_are(tmp_path):
    model = tiny_model()
    model.generation_config.exit_threshold = float("nan")  # was written into the JSON
    with pytest.raises(ValueError, match="Not saved: `exit_threshold` must be finite"):
        model.save_pretrained(tmp_path)
    model.generation_config.exit_threshold, model.generation_config.exit_policy = 0.5, "patience"
    with pytest.raises(ValueError, match="Not saved: `exit_threshold` of the patience policy is one layer count"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "generation_config.json").exists()
    # Saved defaults that do not fit another setting of the config (stream thresholds on a joint encoder) are a
    # call's to override: they save, as the Trainer's checkpoints need.
    model = tiny_model(decompose_encoder_modalities=True)
    model.generation_config.encoder_image_exit_threshold = 0.9
    model.config.decompose_encoder_modalities = False
    model.save_pretrained(tmp_path)
    # A threshold given to `from_pretrained` is checked against the policy a call runs with (the saved patience).
    model = tiny_model(decoder_layers=4)
    model.generation_config.exit_policy, model.generation_config.exit_threshold = "patience", 2
    model.save_pretrained(tmp_path / "patience")
    loaded = type(model).from_pretrained(tmp_path / "patience", exit_threshold=3)
    loaded.generate(**tiny_inputs(), max_new_tokens=2)


def test_a_subclass_whose_forward_takes_keywords_generates():
    class Logged(type(tiny_model())):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = Logged(tiny_config())
    out = model.generate(**tiny_inputs(), max_new_tokens=3, exit_threshold=0.5, return_dict_in_generate=True)
    assert out.exit_layers.shape == (2, 3)


def test_a_user_controller_sees_the_documented_state(model):
    seen = []

    class Recorder(ConfidenceExit):
        def __call__(self, state):
            seen.append((state.part, state.layer, state.step, tuple(state.hidden_states.shape), state.rows.tolist()))
            assert state.logits().shape == (state.rows.shape[0], model.config.vocab_size)
            return super().__call__(state)

    generate(model, batch_of(2), "greedy", exit_controller=Recorder(0.99))
    assert seen[0] == ("decoder", 1, 0, (2, 1, 32), [0, 1])
    assert {layer for _, layer, *_ in seen} <= {1, 2, 3}
    assert max(step for _, _, step, *_ in seen) == NEW_TOKENS - 1


def test_whole_numbers_and_scalar_tensors_are_thresholds_like_floats(model):
    """A patience threshold is a layer count, and 1 a fraction like 1.0: the model config takes them as a call does;
    a 0-d tensor or a NumPy number is the number it holds."""
    import numpy as np

    from hf_earlyexit import OFAEarlyExitConfig

    config = OFAEarlyExitConfig(
        exit_policy="patience", exit_threshold=2, batch_stop_fraction=1, encoder_exit_threshold=0
    )
    assert (config.exit_threshold, config.batch_stop_fraction) == (2, 1)
    inputs = batch_of(2)
    expected = generate(model, inputs, "greedy", exit_threshold=0.5).sequences
    for threshold in (torch.tensor(0.5), np.float32(0.5)):
        assert torch.equal(generate(model, inputs, "greedy", exit_threshold=threshold).sequences, expected)


@pytest.mark.parametrize(
    "knobs", [NO_EXIT, dict(exit_threshold=0.5), dict(exit_mode="speculative", exit_threshold=0.5)]
)
@pytest.mark.parametrize("name", ["decoder_input_ids", "decoder_attention_mask"])
def test_a_decoder_prompt_of_another_batch_size_is_refused_by_name(model, knobs, name):
    prompt = {
        "decoder_input_ids": torch.tensor([[0, 5, 6]]),
        "decoder_attention_mask": torch.ones(1, 3, dtype=torch.long),
    }
    if name == "decoder_attention_mask":
        prompt["decoder_input_ids"] = prompt["decoder_input_ids"].expand(3, -1)
    with pytest.raises(ValueError, match=f"`{name}` has 1 rows but the inputs have 3"):
        model.generate(**batch_of(3), **prompt, max_new_tokens=3, **knobs)


def test_a_cache_built_for_another_strategy_is_refused(model):
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from hf_earlyexit import EarlyExitCache

    cache = EncoderDecoderCache(EarlyExitCache(model.config, "copy"), DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="kv_strategy='recompute'"):
        model.generate(
            **batch_of(2), max_new_tokens=3, past_key_values=cache, exit_threshold=0.5, kv_strategy="recompute"
        )


def test_reused_settings_start_afresh_and_encoder_outputs_can_be_passed_in(model):
    inputs = batch_of(2)
    settings = EarlyExitSettings(decoder=mixed_exits())
    first = model.generate(**inputs, max_new_tokens=4, exit_settings=settings, return_dict_in_generate=True)
    second = model.generate(**inputs, max_new_tokens=4, exit_settings=settings, return_dict_in_generate=True)
    assert torch.equal(first.exit_layers, second.exit_layers) and first.exit_layers.shape[1] == 4
    encoder_outputs = model.get_encoder()(**inputs)
    out = model.generate(
        encoder_outputs=encoder_outputs,
        attention_mask=inputs["attention_mask"],
        max_new_tokens=4,
        exit_settings=settings,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.exit_layers, first.exit_layers) and out.encoder_exit_layers is None


def test_a_config_saying_use_cache_false_still_exits_with_the_cache(model):
    """The Trainer writes `use_cache=False` into configs; exits need the cache, so only an explicit False refuses."""
    inputs = batch_of(2)
    reference = generate(model, inputs, "greedy", exit_controller=mixed_exits())
    model.config.use_cache = False
    try:
        out = generate(model, inputs, "greedy", exit_controller=mixed_exits())
    finally:
        model.config.use_cache = True
    assert torch.equal(out.sequences, reference.sequences)
    assert torch.equal(out.exit_layers, reference.exit_layers)


def test_encoder_exits_alone_decode_without_the_cache_and_saved_decoder_exits_refuse_it_by_name():
    model = tiny_model(decompose_encoder_modalities=True)
    inputs, knobs = batch_of(2), dict(encoder_image_exit_threshold=0.0, max_new_tokens=4, return_dict_in_generate=True)
    with torch.no_grad():
        cached = model.generate(**inputs, **knobs)
        uncached = model.generate(**inputs, **knobs, use_cache=False)
    assert torch.equal(uncached.sequences, cached.sequences)
    assert torch.equal(uncached.encoder_exit_layers, cached.encoder_exit_layers)
    assert int(cached.encoder_exit_layers[:, 0].max()) == 1  # the image stream exited
    model.generation_config.exit_threshold = 0.5  # a saved decoder default
    try:
        with pytest.raises(ValueError, match="use_cache=False.*exit_threshold=None"):
            model.generate(**inputs, max_new_tokens=4, use_cache=False)
    finally:
        del model.generation_config.exit_threshold


@pytest.mark.parametrize(
    ("decomposed", "part", "message"),
    [
        (True, "encoder", r'use `exit_controller=\{"encoder_image": ...\}` / `exit_controller=\{"encoder_text"'),
        (False, "encoder_text", r'this one is joint: use `exit_controller=\{"encoder": ...\}`'),
    ],
)
def test_an_encoder_controller_for_the_other_kind_of_encoder_names_exit_controller(decomposed, part, message):
    model = tiny_model(decompose_encoder_modalities=decomposed)
    with pytest.raises(ValueError, match=message):
        model.generate(**batch_of(2), max_new_tokens=3, exit_controller={part: FixedLayerExit(1)})


def test_no_exit_asks_for_the_full_model_whatever_is_saved():
    import hf_earlyexit

    model = tiny_model(decompose_encoder_modalities=True, decoder_layers=4)
    inputs, kwargs = batch_of(3), dict(max_new_tokens=4, return_dict_in_generate=True)
    with torch.no_grad():
        full = model.generate(**inputs, **kwargs)
        saved = {"exit_threshold": 0.0, "exit_policy": "confidence", "encoder_image_exit_threshold": -1.0}
        for name, value in saved.items():  # what `calibrate --write` saves
            setattr(model.generation_config, name, value)
        exits = model.generate(**inputs, **kwargs)
        again = model.generate(**inputs, **kwargs, **hf_earlyexit.NO_EXIT)
    assert int(exits.exit_layers.max()) == 1 and int(exits.encoder_exit_layers[:, 0].max()) == 1
    assert torch.equal(again.sequences, full.sequences) and torch.equal(again.exit_layers, full.exit_layers)
    assert torch.equal(again.encoder_exit_layers, full.encoder_exit_layers)


def test_concurrent_generate_calls_with_different_knobs_equal_serial_ones():
    import threading

    model = tiny_model(decoder_layers=4, decompose_encoder_modalities=True).eval()
    inputs = tiny_inputs(batch=3)
    cases = [
        {"exit_threshold": None},
        {"exit_policy": "confidence", "exit_threshold": 0.2, "kv_strategy": "copy"},
        {"exit_threshold": 0.5, "encoder_image_exit_threshold": 0.5, "num_beams": 2},
        {"exit_mode": "speculative", "exit_policy": "confidence", "exit_threshold": 0.3},
        {"exit_policy": "patience", "exit_threshold": 1, "row_exit": "compact"},
    ]

    def run(knobs):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, return_dict_in_generate=True, **knobs)
        return out.sequences, out.exit_layers

    serial = [run(knobs) for knobs in cases]
    concurrent = [None] * len(cases)

    def work(index):
        concurrent[index] = run(cases[index])

    threads = [threading.Thread(target=work, args=(index,)) for index in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (sequences, layers), (got_sequences, got_layers) in zip(serial, concurrent, strict=True):
        assert torch.equal(sequences, got_sequences) and torch.equal(layers, got_layers)


def test_a_stateful_controller_serves_one_generate_call_at_a_time():
    import threading

    class Blocking(PatienceExit):  # holds its first call until released
        def __init__(self):
            super().__init__(patience=2)
            self.entered, self.release = threading.Event(), threading.Event()

        def __call__(self, state):
            self.entered.set()
            self.release.wait(timeout=30)
            return super().__call__(state)

    model, inputs, controller = tiny_model(decoder_layers=4).eval(), tiny_inputs(batch=2), Blocking()
    first = threading.Thread(target=lambda: model.generate(**inputs, max_new_tokens=3, exit_controller=controller))
    first.start()
    assert controller.entered.wait(timeout=30)
    try:
        with pytest.raises(ValueError, match="another `generate` call"):
            model.generate(**inputs, max_new_tokens=3, exit_controller=controller)
        model.generate(**inputs, max_new_tokens=3, exit_controller=FixedLayerExit(2))  # stateless: no claim needed
    finally:
        controller.release.set()
        first.join()
    assert controller.keeps_state and not FixedLayerExit(2).keeps_state
    assert model.generate(**inputs, max_new_tokens=3, exit_controller=controller).shape[0] == 2  # released


@pytest.mark.parametrize(
    "decoding",
    [{}, {"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}],
    ids=["greedy", "beams", "sampled"],
)
def test_thresholds_per_request_give_each_row_its_own_run(decoding):
    model = tiny_model(decoder_layers=4, decompose_encoder_modalities=True).eval()
    inputs = tiny_inputs(batch=3, pad_last=0)
    thresholds = {"exit_threshold": [0.0, 1.0, 0.3], "encoder_image_exit_threshold": torch.tensor([-1.0, 1.0, 0.5])}
    knobs = {"exit_policy": "confidence", "max_new_tokens": 6, "return_dict_in_generate": True, **decoding}

    def run(batch, **given):
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(**batch, **knobs, **given)

    together = run(inputs, **thresholds)
    rows = together.sequences.shape[0] // 3
    for request in range(3):
        alone = run(
            {name: value[request : request + 1] for name, value in inputs.items()},
            **{name: float(value[request]) for name, value in thresholds.items()},
        )
        block = slice(request * rows, (request + 1) * rows)
        if not decoding.get("do_sample"):  # sampling draws from one generator for the whole batch
            assert torch.equal(together.sequences[block, : alone.sequences.shape[1]], alone.sequences)
            assert torch.equal(together.exit_layers[block, : alone.exit_layers.shape[1]], alone.exit_layers)
        assert torch.equal(together.encoder_exit_layers[block], alone.encoder_exit_layers)
    assert set(together.exit_layers[rows : 2 * rows].unique().tolist()) <= {0, 4}  # threshold 1.0: never exits
    assert set(together.exit_layers[:rows].unique().tolist()) <= {0, 1}  # threshold 0.0: always after layer 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"exit_threshold": [0.5, 0.5]}, "`exit_threshold` has 2 values: give one per request of the batch \\(3\\)"),
        ({"exit_threshold": [0.5, 2.0, 0.5]}, "exit_threshold"),
        ({"exit_threshold": [[0.5], [0.5], [0.5]]}, "exit_threshold"),
        ({"encoder_image_exit_threshold": [0.5, 0.5, 3.0]}, "encoder_image_exit_threshold"),
        ({"exit_policy": "patience", "exit_threshold": [1, 2, 1]}, "patience"),
    ],
)
def test_bad_thresholds_per_request_name_the_knob(knobs, message):
    model = tiny_model(decoder_layers=4, decompose_encoder_modalities=True).eval()
    with pytest.raises(ValueError, match=message):
        model.generate(**tiny_inputs(batch=3), max_new_tokens=3, **{"exit_policy": "confidence", **knobs})


@pytest.mark.parametrize("knobs", [{}, {"exit_mode": "exit"}, {"exit_mode": "speculative"}])
def test_generate_without_max_new_tokens_decodes_to_max_length(model, knobs):
    """Transformers 5 leaves `max_length` unset in a config: a call with `max_length`, or with no length at all
    (Transformers' default of 20), decodes in every mode."""
    inputs = batch_of(2)
    knobs = {**knobs, "exit_controller": mixed_exits()} if knobs else knobs
    assert model.generation_config.max_length is None and model.generation_config.max_new_tokens is None
    with torch.no_grad():
        short = model.generate(**inputs, max_length=6, min_length=6, **knobs)
        default = model.generate(**inputs, **knobs)
    assert short.shape == (2, 6) and default.shape[1] <= 21


def test_after_a_decoder_prompt_schedules_count_its_new_tokens_under_max_length_and_max_new_tokens(model):
    """A threshold schedule decays over the steps a call may decode (`max_length` less the decoder's prompt), and the
    first new token is step 0 whatever the prompt: the same schedule, the same exits per new token."""
    seen = []

    class Steps(ExitController):
        def __call__(self, state):
            seen.append((state.step, state.max_steps))
            return torch.zeros(state.rows.shape[0], dtype=torch.bool, device=state.hidden_states.device)

    prompt = {"decoder_input_ids": torch.tensor([[0, 5, 6, 7, 8]] * 2)}
    for inputs, length in (({}, {"max_new_tokens": 4}), (prompt, {"max_new_tokens": 4}), (prompt, {"max_length": 9})):
        seen.clear()
        with torch.no_grad():
            model.generate(**batch_of(2), **inputs, **length, exit_controller=Steps(), eos_token_id=None)
        assert sorted(set(seen)) == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_a_passed_generation_config_is_completed_by_the_models_as_transformers_does(model):
    """Transformers fills a passed config's unset fields and missing entries from the model's generation config: the
    exits see the same, so the saved beams expand per-request thresholds, the saved exit knobs apply, and speculative
    mode is refused under the saved beams instead of decoding lossy beam search."""
    inputs = batch_of(2)
    model.generation_config.num_beams = 3
    model.generation_config.exit_controller = mixed_exits()
    try:
        with torch.no_grad():
            out = model.generate(
                **inputs, generation_config=GenerationConfig(max_new_tokens=4, return_dict_in_generate=True)
            )
            per_request = model.generate(**inputs, generation_config=GenerationConfig(max_new_tokens=4),
                                         exit_policy="confidence", exit_threshold=[0.05, 0.5])  # fmt: skip
        with pytest.raises(ValueError, match="num_beams=1"):
            model.generate(**inputs, generation_config=GenerationConfig(max_new_tokens=4), exit_mode="speculative")
    finally:
        model.generation_config.num_beams = None
        del model.generation_config.exit_controller
    assert out.exit_layers.min() < DEPTH and per_request.shape[0] == 2


def test_exits_beside_a_passed_generation_config_add_no_kwargs_warning(model, monkeypatch):
    """The cache that exits need is set on the call's config, not passed as a kwarg beside it (which Transformers
    warns about)."""
    import transformers.generation.utils as generation_utils

    warnings = []
    monkeypatch.setattr(generation_utils.logger, "warning_once", lambda message, *args: warnings.append(message))
    with torch.no_grad():
        model.generate(
            **batch_of(1), generation_config=GenerationConfig(max_new_tokens=3), exit_controller=mixed_exits()
        )
        model.generate(**batch_of(1), generation_config=GenerationConfig(max_new_tokens=3), use_cache=True)
    assert len(warnings) == 1 and "deprecated" in warnings[0]  # the second call's own kwarg only


def test_measuring_the_layer_costs_leaves_a_seeded_sampling_call_unchanged(model):
    """`row_exit="auto"` measures a layer on its first stop of a shape, with random inputs: the caller's seed still
    gives the samples it gives once the costs are known."""
    model.decoder.measured_layer_costs.clear()
    model.encoder.measured_layer_costs.clear()
    first = generate(model, batch_of(4), "sample", exit_controller=mixed_exits())
    measured = generate(model, batch_of(4), "sample", exit_controller=mixed_exits())
    assert torch.equal(first.sequences, measured.sequences)


def test_stop_strings_stop_decoding_in_every_mode():
    """Transformers hands the decoding loop the `tokenizer` that `stop_strings` need; it is no model input."""
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, load_model_and_processor
    from hf_earlyexit.scenes import scene

    embedded, processor = load_model_and_processor(EMBEDDED_MODEL_DIR)
    inputs = processor(images=scene(7, 0, image_size=64)[0], text=" what does the image describe?", return_tensors="pt")
    options = dict(max_new_tokens=24, stop_strings=["purple"], tokenizer=processor.tokenizer)
    with torch.no_grad():
        for knobs in (NO_EXIT, {}, {"exit_mode": "speculative"}):
            text = processor.batch_decode(embedded.generate(**inputs, **options, **knobs), skip_special_tokens=True)
            assert text[0].endswith("purple"), (knobs, text)


def test_a_misspelt_knob_saved_in_a_config_is_refused_not_ignored(model):
    inputs = batch_of(1)
    with pytest.raises(ValueError, match="exit_treshold.*did you mean `exit_threshold`"):
        model.generate(**inputs, generation_config=GenerationConfig(max_new_tokens=2, exit_treshold=0.1))
    for config, where in ((model.generation_config, "generation config"), (model.config, "model config")):
        config.kv_strategie = "copy"
        try:
            with pytest.raises(ValueError, match=f"{where} has `kv_strategie`.*`kv_strategy`"):
                model.generate(**inputs, max_new_tokens=2)
        finally:
            del config.kv_strategie


def test_greedy_exit_layers_are_zero_past_a_rows_end_as_in_beam_search(model):
    inputs = batch_of(4)
    full = generate(model, inputs, "greedy", **NO_EXIT)
    end = int(full.sequences[0, 1])  # row 0's first token: its end, and that of rows that start alike
    for mode in ("greedy", "sample"):
        out = generate(model, inputs, mode, exit_controller=mixed_exits(), eos_token_id=end)
        new = out.sequences[:, 1:]
        ended = new == end
        past_end = ended.cumsum(dim=1) - ended.long() > 0
        assert bool(past_end.any()), mode
        assert bool((out.exit_layers[past_end] == 0).all()) and bool((out.exit_layers[~past_end] > 0).all()), mode


def test_generate_refuses_decoder_inputs_embeds_with_a_message_that_says_what_to_pass(model):
    embeds = model.get_input_embeddings()(torch.tensor([[0]]))
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model.generate(**batch_of(1), decoder_inputs_embeds=embeds, max_new_tokens=2)


@pytest.mark.parametrize(
    "knobs",
    [NO_EXIT, dict(exit_threshold=0.5), dict(exit_threshold=0.5, exit_mode="speculative")],
    ids=["full", "exits", "speculative"],
)
def test_generate_refuses_classifier_free_guidance_by_name(model, knobs):
    with pytest.raises(ValueError, match="guidance_scale"):
        model.generate(**batch_of(1), guidance_scale=1.5, max_new_tokens=2, **knobs)
    model.generate(**batch_of(1), guidance_scale=1.0, max_new_tokens=2, **knobs)  # 1: no guidance


@pytest.mark.parametrize("mode", [{}, {"exit_controller": mixed_exits()}, {"exit_mode": "speculative"}])
def test_a_call_past_the_decoders_positions_stops_there_with_a_warning(monkeypatch, mode):
    """What a pipeline's default of 256 new tokens asks of a model with fewer positions: the tokens decoded up to
    the positions are kept, not lost to the refusal of the step past them."""
    from transformers.generation import utils as generation_utils

    from hf_earlyexit.modeling import generation_early_exit

    model, said, stock = tiny_model(decoder_layers=DEPTH, max_position_embeddings=12, token_bucket_size=16), [], []
    monkeypatch.setattr(generation_early_exit.logger, "warning_once", said.append)
    monkeypatch.setattr(generation_utils.logger, "warning", stock.append)
    knobs = mode if mode.get("exit_mode") != "speculative" else {**mode, "exit_controller": FixedLayerExit(1)}
    with torch.no_grad():
        out = model.generate(**batch_of(2), max_new_tokens=40, eos_token_id=None, **knobs)
        prompted = model.generate(**batch_of(2), decoder_input_ids=torch.zeros(2, 3, dtype=torch.long),
                                  max_length=40, eos_token_id=None, **knobs)  # fmt: skip
    assert out.shape[1] == 13 and prompted.shape[1] == 13  # the newest token is never fed
    assert said and "decoding stops after 12" in said[0]
    assert not [message for message in stock if "max_new_tokens" in message]  # the call's own bound is capped


def test_a_decoder_cache_alone_serves_as_bart_takes_it(model):
    """A bare `DynamicCache` or `EarlyExitCache` is the self-attention cache, beside a new cross-attention one; the
    caller's object holds the tokens."""
    from transformers.cache_utils import DynamicCache

    inputs, kwargs = batch_of(2), dict(eos_token_id=None, do_sample=False, max_new_tokens=6)
    lossy = dict(exit_controller=FixedLayerExit(2), kv_strategy="recompute")
    with torch.no_grad():
        full, exits = model.generate(**inputs, **kwargs, **NO_EXIT), model.generate(**inputs, **kwargs, **lossy)
        for cache, knobs, expected in (
            (DynamicCache(), NO_EXIT, full),
            (EarlyExitCache(model.config), NO_EXIT, full),
            (EarlyExitCache(model.config, "recompute"), lossy, exits),
            (
                EarlyExitCache(model.config, "recompute"),
                dict(exit_mode="speculative", exit_controller=FixedLayerExit(1)),
                full,
            ),
        ):
            assert torch.equal(model.generate(**inputs, past_key_values=cache, **kwargs, **knobs), expected)
            assert cache.get_seq_length() >= expected.shape[1] - 1
        ids, cache = full[:, :3], DynamicCache()
        model(**inputs, decoder_input_ids=ids[:, :2], past_key_values=cache, use_cache=True)
        step = model(**inputs, decoder_input_ids=ids[:, 2:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(step, model(**inputs, decoder_input_ids=ids).logits[:, 2:], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "knobs", [{"exit_threshold": 0.5}, NO_EXIT, {"exit_mode": "speculative", "exit_threshold": 0.5}]
)
def test_a_cache_of_another_depth_is_refused_by_name(knobs):
    """Speculative mode read a 3-layer cache's layer 3 as the full model's and decoded other tokens, silently."""
    model, strategy = tiny_model(decoder_layers=4), "recompute" if "exit_mode" in knobs else "propagate"
    for depth in (3, 5):
        cache = EarlyExitCache(tiny_config(decoder_layers=depth), strategy)
        with pytest.raises(ValueError, match=f"The EarlyExitCache has {depth} layers, the decoder 4"):
            model.generate(**tiny_inputs(), max_new_tokens=3, past_key_values=cache, **knobs)


def test_a_cache_of_other_rows_is_refused_by_name():
    model, inputs = tiny_model(decoder_layers=4), tiny_inputs()
    first = model.generate(**inputs, max_new_tokens=3, exit_threshold=0.5, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="The cache passed in holds 2 rows, this call decodes 6"):
        model.generate(
            **inputs, decoder_input_ids=first.sequences, past_key_values=first.past_key_values, num_beams=3,
            max_new_tokens=3, exit_threshold=0.5,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"encoder_exit_threshold": 0.0}, "['encoder_exit_threshold']"),
        ({"exit_controller": {"encoder": FixedLayerExit(1)}}, """['exit_controller["encoder"]']"""),
    ],
)
def test_encoder_exits_given_with_encoder_outputs_are_refused_by_name(knobs, named):
    """They changed nothing, silently: the encoder had already run."""
    model, inputs = tiny_model(decoder_layers=4), tiny_inputs()
    encoder_outputs = model.get_encoder()(**inputs)
    with pytest.raises(ValueError, match=f"{re.escape(named)} set the encoder's exits, but `encoder_outputs`"):
        model.generate(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], max_new_tokens=3,
                       **knobs)  # fmt: skip
    model.generate(
        encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"], max_new_tokens=3, **NO_EXIT
    )  # fmt: skip  (the saved or turned-off encoder knobs are no error)
