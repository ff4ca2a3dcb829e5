"""Exit heads in the model: DEED's adapters and BLIPEE's exit transformer layers, declared in the config, used by
`generate`, and the identity until trained."""

import pytest
import torch

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, FixedLayerExit
from hf_earlyexit.modeling.exit_knobs import KV_STRATEGIES
from tests.helpers import tiny_config, tiny_inputs, tiny_model

DEPTH = 4
HEADS = [{"exit_adapter_dim": 8}, {"exit_transformer_layers": [1, 3]}]


def generate(model, inputs, **kwargs):
    return model.generate(
        **inputs, max_new_tokens=6, return_dict_in_generate=True, output_scores=True, do_sample=False, **kwargs
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"exit_adapter_dim": 0}, "exit_adapter_dim"),
        ({"exit_transformer_layers": [4]}, "before the last"),
        ({"exit_transformer_layers": [3, 1]}, "increasing"),
        ({"exit_transformer_layers": []}, "increasing"),
        ({"exit_adapter_dim": 8, "exit_transformer_layers": [1]}, "not both"),
    ],
)
def test_bad_exit_head_fields_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(decoder_layers=DEPTH, **fields)


@pytest.mark.parametrize("heads", HEADS)
def test_untrained_exit_heads_are_the_identity(heads):
    torch.manual_seed(0)
    model = EarlyExitOFAForConditionalGeneration(tiny_config(decoder_layers=DEPTH, **heads)).eval()
    inputs = tiny_inputs(batch=2)
    out = model(**inputs, decoder_input_ids=torch.zeros(2, 3, dtype=torch.long), output_hidden_states=True,
                output_exit_hidden_states=True)  # fmt: skip
    for layer, features in zip(model.config.exit_points, out.exit_hidden_states, strict=False):
        torch.testing.assert_close(features, model.decoder.layer_norm(out.decoder_hidden_states[layer]))
    assert len(out.exit_hidden_states) == len(model.config.exit_points) + 1


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("strategy", KV_STRATEGIES)
def test_exit_heads_that_never_fire_give_the_full_model(heads, strategy):
    model = tiny_model(decoder_layers=DEPTH, **heads)
    inputs = tiny_inputs(batch=3, seed=2)
    for options in ({}, {"num_beams": 3}):
        full = generate(model, inputs, **options)
        # confidence at 1.0 computes every exit head's logits and never stops
        out = generate(model, inputs, exit_policy="confidence", exit_threshold=1.0, kv_strategy=strategy, **options)
        assert torch.equal(out.sequences, full.sequences)
        for ours, theirs in zip(out.scores, full.scores, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_tokens_exit_only_after_layers_that_carry_an_exit_layer():
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2, 3])
    inputs = tiny_inputs(batch=2)
    eager = generate(model, inputs, exit_policy="confidence", exit_threshold=0.0)
    assert bool((eager.exit_layers[eager.exit_layers > 0] == 2).all())  # 0: past a row's end
    later = generate(model, inputs, exit_policy="confidence", exit_threshold=0.0, min_exit_layer=3)
    assert bool((later.exit_layers[later.exit_layers > 0] == 3).all())  # 0: past a row's end
    forced = generate(model, inputs, exit_controller=FixedLayerExit(1))  # layer 1 has no exit: not asked there
    assert bool((forced.exit_layers[forced.exit_layers > 0] == 2).all())  # 0: past a row's end


@pytest.mark.parametrize("heads", HEADS)
def test_an_exited_token_is_decoded_by_its_exit_head(heads):
    """Forced exit after layer 1 (adapters) or 3 (exit layers): the logits are the exit head's, not the layer's."""
    model = tiny_model(decoder_layers=DEPTH, **heads)
    layer = model.config.exit_points[-1]
    inputs = tiny_inputs(batch=2, seed=5)
    out = generate(model, inputs, exit_controller=FixedLayerExit(layer))
    forward = model(**inputs, decoder_input_ids=out.sequences[:, :-1], output_exit_hidden_states=True)
    expected = model.decoder.output_projection(forward.exit_hidden_states[model.config.exit_points.index(layer)])
    torch.testing.assert_close(out.scores[0], expected[:, 0], rtol=0, atol=1e-5)
    assert torch.equal(out.sequences[:, 1:-1], expected.argmax(-1)[:, :-1])


@pytest.mark.parametrize("strategy", KV_STRATEGIES)
def test_a_batch_with_exit_layers_gives_the_tokens_of_its_rows_run_one_by_one(strategy):
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[1, 3])

    def mixed(offset: int = 0) -> FixedLayerExit:  # layer 1, 3 or full depth, by row and step
        return FixedLayerExit(lambda state: torch.tensor([1, 3, 4])[(state.rows + offset + state.step) % 3])

    inputs = tiny_inputs(batch=3, seed=7, pad_last=2)
    batched = generate(model, inputs, exit_controller=mixed(), kv_strategy=strategy, row_exit="compact")
    assert set(batched.exit_layers.unique().tolist()) >= {1, 3, 4}
    for row in range(3):
        real = inputs["attention_mask"][row].bool()
        single = {name: inputs[name][row : row + 1, real] for name in ("input_ids", "attention_mask")}
        single["pixel_values"] = inputs["pixel_values"][row : row + 1]
        alone = generate(model, single, exit_controller=mixed(offset=row), kv_strategy=strategy)
        length = alone.sequences.shape[1]
        assert torch.equal(batched.sequences[row, :length], alone.sequences[0])
        assert torch.equal(batched.exit_layers[row, : length - 1], alone.exit_layers[0])
