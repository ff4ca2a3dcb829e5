"""The benchmark's ideal: a model truncated to K layers is exactly the full model forced to exit after K."""

import torch

from hf_earlyexit import EarlyExitSettings, FixedLayerExit
from hf_earlyexit.benchmark import truncated_model
from tests.helpers import tiny_inputs, tiny_model


def test_truncated_model_shares_weights_and_equals_the_forced_exit():
    model = tiny_model(encoder_layers=3, decoder_layers=4)
    truncated = truncated_model(model, encoder_layers=2, decoder_layers=2)
    assert truncated.decoder.layers[1].fc1.weight.data_ptr() == model.decoder.layers[1].fc1.weight.data_ptr()
    assert len(truncated.decoder.layers) == 2 and len(truncated.encoder.layers) == 2
    inputs = tiny_inputs(batch=3)
    settings = EarlyExitSettings(decoder=FixedLayerExit(2), encoder=FixedLayerExit(2))
    decoder_input_ids = torch.tensor([[0, 4, 9], [0, 17, 3], [0, 5, 5]])
    with torch.no_grad():
        forced = model(**inputs, decoder_input_ids=decoder_input_ids, exit_settings=settings).logits
        ideal = truncated(**inputs, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(forced, ideal, rtol=0, atol=1e-6)
    generated = model.generate(
        **inputs, max_new_tokens=6, exit_controller={"decoder": FixedLayerExit(2), "encoder": FixedLayerExit(2)}
    )
    assert torch.equal(generated, truncated.generate(**inputs, max_new_tokens=6))
