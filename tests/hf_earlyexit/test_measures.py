"""Expected time reduction and parameter speedup against hand-computed values."""

import pytest
import torch

from hf_earlyexit.measures import PartCosts, batch_deepest, expected_time_reduction, parameter_speedup
from tests.helpers import tiny_config, tiny_model


def test_expected_time_reduction_weights_layers_by_part_cost():
    costs = PartCosts(encoder_image=2, encoder_text=1, decoder=3, encoder_fixed=10, decoder_fixed=5)
    encoder = torch.tensor([[2, 4], [4, 1]])
    decoder = torch.tensor([[1, 4, 0], [2, 2, 2]])  # 0: no token there
    # run: 2*(2+4) + 1*(4+1) + 3*11 + 10*2 + 5*5 = 95; full: 3*4*2 + 3*4*5 + 20 + 25 = 129
    assert expected_time_reduction(encoder, decoder, costs, 4, 4) == pytest.approx(1 - 95 / 129)
    assert expected_time_reduction(torch.full((2, 2), 4), torch.full((2, 3), 4), costs, 4, 4) == 0.0
    with pytest.raises(ValueError, match="deeper"):
        expected_time_reduction(encoder, decoder + 4, costs, 4, 4)


def test_batch_aware_time_reduction_charges_each_step_its_deepest_row():
    costs = PartCosts(encoder_image=1, encoder_text=0, decoder=1)
    encoder = torch.tensor([[1, 1], [3, 3], [2, 2]])
    decoder = torch.tensor([[1, 4, 0], [2, 2, 2], [1, 1, 1]])
    # Batches of 2: rows 0-1 run the deepest of each column, (3, 3) and steps (2, 4, 2), row 0 riding along in the
    # last step after its end; row 2 is a batch of its own.
    assert batch_deepest(decoder, 2).tolist() == [[2, 4, 2], [2, 4, 2], [1, 1, 1]]
    assert batch_deepest(encoder, 2)[:, 0].tolist() == [3, 3, 2]
    assert batch_deepest(torch.tensor([[1, 0], [2, 0]]), 2).tolist() == [[2, 0], [2, 0]]  # no row ran step 2
    per_row = expected_time_reduction(encoder, decoder, costs, 4, 4)
    batched = expected_time_reduction(encoder, decoder, costs, 4, 4, batch_size=2)
    # run: encoder 3 + 3 + 2 = 8, decoder 2 * (2 + 4 + 2) + 3 = 19; full, on the same 9 row-steps: 12 + 36 = 48
    assert batched == pytest.approx(1 - 27 / 48) and batched < per_row
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, batch_size=3) <= batched
    with pytest.raises(ValueError, match="batch_size"):
        expected_time_reduction(encoder, decoder, costs, 4, 4, batch_size=0)


def test_a_token_pays_an_ask_at_each_asked_layer_up_to_its_exit():
    costs = PartCosts(encoder_image=0, encoder_text=0, decoder=2, decoder_asks={"confidence": 0.5})
    encoder = torch.zeros(2, 2, dtype=torch.long)
    decoder = torch.tensor([[1, 4, 0], [3, 4, 2]])
    asked = (1, 2, 3)  # asks per token: 1, 3, -, 3, 3, 2 = 12
    # run: 2 * 14 + 0.5 * 12 = 34; full: 2 * 4 * 5 = 40
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, 1, asked, "confidence") == pytest.approx(1 - 34 / 40)
    # Batch-aware: each step runs and asks up to its deepest row, (3, 4, 2), for both rows (row 0 rides along in
    # the last): 18 layers and 2 * (3 + 3 + 2) = 16 asks, against the full depth on those 6 row-steps.
    batched = expected_time_reduction(encoder, decoder, costs, 4, 4, 2, asked, "confidence")
    assert batched == pytest.approx(1 - (36 + 8) / 48)
    # Asking only after layer 1 costs one ask per token; layer counts alone (FLOPs) see no ask.
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, 1, (1,), "confidence") == pytest.approx(1 - 30.5 / 40)
    layers_only = PartCosts(encoder_image=0, encoder_text=0, decoder=2)
    assert expected_time_reduction(encoder, decoder, layers_only, 4, 4, 1, asked, "confidence") == pytest.approx(0.3)
    with pytest.raises(ValueError, match="similarity"):
        expected_time_reduction(encoder, decoder, costs, 4, 4, 1, asked, "similarity")


def test_a_step_with_a_decoder_controller_pays_the_exit_path_per_token():
    costs = PartCosts(encoder_image=0, encoder_text=0, decoder=2, decoder_asks={"confidence": 0.5}, decoder_exit_path=1)
    encoder = torch.zeros(2, 2, dtype=torch.long)
    decoder = torch.tensor([[1, 4, 0], [3, 4, 2]])  # 5 tokens, 14 layers; full: 2 * 4 * 5 = 40
    # With the controller asked after layer 1: layers 28, asks 0.5 * 5, the exit path 1 * 5.
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, 1, (1,), "confidence") == pytest.approx(1 - 35.5 / 40)
    # Batch-aware, every row of the 3 steps pays it: layers 2 * 18, asks 0.5 * 6, the exit path 6.
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, 2, (1,), "confidence") == pytest.approx(1 - 45 / 48)
    # Without a decoder controller (encoder exits only) the decoder runs without the exit path.
    assert expected_time_reduction(encoder, decoder, costs, 4, 4) == pytest.approx(0.3)


def test_a_sample_pays_each_asked_streams_test_up_to_its_exit():
    costs = PartCosts(
        encoder_image=1, encoder_text=1, decoder=0, encoder_asks={"encoder_image": 0.5, "encoder_text": 2}
    )
    encoder = torch.tensor([[2, 4], [4, 3]])  # image, text exit layers of 2 samples, of 4
    decoder = torch.zeros(2, 1, dtype=torch.long)
    # Only the text stream asked, after layers 2 and 3: 2 asks for sample 0 (exit 4), 2 for sample 1 (exit 3).
    # run: layers 6 + 7 = 13, asks 2 * 4 = 8; full: 2 streams * 4 layers * 2 samples = 16.
    text = {"encoder_text": (2, 3)}
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, encoder_asked_layers=text) == pytest.approx(
        1 - 21 / 16
    )
    # Both streams asked after layer 1 to 3: image asks 2 + 3, text 3 + 3.
    both = {"encoder_image": (1, 2, 3), "encoder_text": (1, 2, 3)}
    run = 13 + 0.5 * 5 + 2 * 6
    assert expected_time_reduction(encoder, decoder, costs, 4, 4, encoder_asked_layers=both) == pytest.approx(
        1 - run / 16
    )
    # Layer counts alone (FLOPs) see no ask; measured costs without a stream's test are an error.
    layers_only = PartCosts(encoder_image=1, encoder_text=1, decoder=0)
    assert expected_time_reduction(encoder, decoder, layers_only, 4, 4, encoder_asked_layers=both) == pytest.approx(
        1 - 13 / 16
    )
    with pytest.raises(ValueError, match="encoder part 'encoder'"):
        expected_time_reduction(encoder, decoder, costs, 4, 4, encoder_asked_layers={"encoder": (1,)})


def test_costs_from_config_count_the_streams_of_a_decomposed_encoder():
    joint = PartCosts.from_config(tiny_config(), image_tokens=16, text_tokens=8, target_tokens=10)
    decomposed = PartCosts.from_config(
        tiny_config(decompose_encoder_modalities=True), image_tokens=16, text_tokens=8, target_tokens=10
    )
    assert joint.encoder_text == 0 and decomposed.encoder_text > 0
    assert decomposed.encoder_image + decomposed.encoder_text < joint.encoder_image  # no cross-modal attention
    d, ffn = 32, 64
    assert joint.encoder_image == 2.0 * 24 * (4 * d * d + 2 * d * ffn + 2 * d * 24)
    assert joint.decoder_fixed == 2.0 * d * 120


@pytest.mark.parametrize("heads", [{}, {"exit_transformer_layers": [2]}])
def test_parameter_speedup_counts_the_layers_and_exit_head_a_token_used(heads):
    model = tiny_model(decoder_layers=4, **heads)
    decoder = model.decoder
    per_layer = sum(p.numel() for p in decoder.layers[0].parameters())
    assert decoder.embed_tokens.weight is decoder.output_projection.weight  # tied: one tensor, counted once
    shared = decoder.embed_tokens.weight.numel()
    head = sum(p.numel() for p in decoder.exit_transformer_layers.parameters()) if heads else 0
    exits = torch.tensor([[2, 2, 4, 0]])  # two tokens left after layer 2, one ran all 4
    used = (2 * (2 * per_layer + head + shared) + 4 * per_layer + shared) / 3
    assert parameter_speedup(model, exits) == pytest.approx((4 * per_layer + shared) / used)
    with pytest.raises(ValueError, match="No generated token"):
        parameter_speedup(model, torch.zeros(1, 3, dtype=torch.long))
