"""The checks Transformers runs on its own models, on a tiny OFA-EE config: outputs and their shapes, generation
modes with and without exits, training utilities and the cache. Parity, exits, export and save/load have their own
files beside this one; this is the common ground a Transformers user assumes."""

import pytest
import torch
from transformers import GenerationConfig

from tests.helpers import tiny_inputs, tiny_model

DECODER_LAYERS, ENCODER_LAYERS = 3, 2


@pytest.fixture(scope="module")
def model():
    return tiny_model(decoder_layers=DECODER_LAYERS, encoder_layers=ENCODER_LAYERS).eval()


def teacher_forced(length: int = 4) -> dict:
    decoder = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(0))
    return {**tiny_inputs(batch=2), "decoder_input_ids": decoder}


def test_hidden_states_and_attentions_have_one_entry_per_layer(model):
    with torch.no_grad():
        out = model(**teacher_forced(), output_hidden_states=True, output_attentions=True)
    d, heads, vocab = model.config.d_model, model.config.decoder_attention_heads, model.config.vocab_size
    assert out.logits.shape == (2, 4, vocab)
    assert len(out.decoder_hidden_states) == DECODER_LAYERS + 1 and out.decoder_hidden_states[0].shape == (2, 4, d)
    assert len(out.encoder_hidden_states) == ENCODER_LAYERS + 1 and len(out.encoder_attentions) == ENCODER_LAYERS
    assert len(out.decoder_attentions) == DECODER_LAYERS and out.decoder_attentions[0].shape[:3] == (2, heads, 4)
    assert len(out.cross_attentions) == DECODER_LAYERS
    source = out.encoder_last_hidden_state.shape[1]
    assert out.cross_attentions[0].shape == (2, heads, 4, source)
    assert torch.allclose(out.decoder_attentions[0].sum(-1), torch.ones(2, heads, 4), atol=1e-5)  # probabilities


def test_a_tuple_output_without_return_dict(model):
    kwargs = teacher_forced()
    with torch.no_grad():
        as_tuple = model(**kwargs, return_dict=False, use_cache=False)
        as_dict = model(**kwargs, use_cache=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_dict.logits)


@pytest.mark.parametrize(
    "decoding",
    [
        {},
        {"do_sample": True, "top_k": 5, "num_return_sequences": 2},
        {"num_beams": 3, "num_return_sequences": 2},
        {"num_beams": 3, "exit_threshold": 0.5},
        {"do_sample": True, "exit_policy": "confidence", "exit_threshold": 0.3},
        {"exit_policy": "confidence", "exit_threshold": 0.3, "exit_mode": "speculative"},
    ],
    ids=["greedy", "sample", "beams", "beams-exits", "sample-exits", "speculative"],
)
def test_every_generation_mode_returns_its_shapes(model, decoding):
    torch.manual_seed(0)
    config = GenerationConfig(
        max_new_tokens=5, min_new_tokens=5, decoder_start_token_id=0, eos_token_id=2, pad_token_id=1
    )
    with torch.no_grad():
        out = model.generate(**tiny_inputs(batch=2), generation_config=config, return_dict_in_generate=True,
                             output_scores=True, **decoding)  # fmt: skip
    rows = 2 * decoding.get("num_return_sequences", 1)
    assert out.sequences.shape == (rows, 6) and len(out.scores) == 5
    assert out.exit_layers.shape == (rows, 5) and int(out.exit_layers.max()) <= DECODER_LAYERS


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model(decoder_layers=DECODER_LAYERS, encoder_layers=ENCODER_LAYERS, dropout=0.0).train()
    batch = {**tiny_inputs(batch=2), "labels": torch.randint(3, 100, (2, 5))}

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(**batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys()
    assert all(torch.allclose(plain[name], checkpointed[name], atol=1e-6) for name in plain)


def test_resized_token_embeddings_stay_tied_and_generate():
    model = tiny_model(decoder_layers=DECODER_LAYERS, encoder_layers=ENCODER_LAYERS).eval()
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8, mean_resizing=False)
    assert model.config.vocab_size == vocab + 8
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():
        sequences = model.generate(**tiny_inputs(batch=2), max_new_tokens=4, exit_threshold=0.5)
        logits = model(**tiny_inputs(batch=2), decoder_input_ids=sequences).logits
    assert logits.shape[-1] == vocab + 8


@pytest.mark.parametrize(
    "decoding",
    [{}, {"do_sample": True, "top_k": 5, "num_return_sequences": 2}, {"num_beams": 3}],
    ids=["greedy", "sample", "beams"],
)
def test_a_static_cache_decodes_the_full_model_as_the_dynamic_cache_does(model, decoding):
    outputs = []
    for cache in ({}, {"cache_implementation": "static"}):
        torch.manual_seed(0)
        with torch.no_grad():
            outputs.append(model.generate(**tiny_inputs(batch=3), max_new_tokens=6, return_dict_in_generate=True,
                                          output_scores=True, **decoding, **cache))  # fmt: skip
    dynamic, static = outputs
    assert type(static.past_key_values.self_attention_cache).__name__ == "StaticCache"
    assert torch.equal(static.sequences, dynamic.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(static.scores, dynamic.scores, strict=True))


def test_a_static_cache_reads_a_decoder_attention_mask_like_the_teacher_forced_pass(model):
    from transformers import EncoderDecoderCache, StaticCache

    kwargs = teacher_forced(length=5)
    mask = torch.ones_like(kwargs["decoder_input_ids"])
    mask[1, :2] = 0  # the second row's decoder prompt is left-padded
    with torch.no_grad():
        whole = model(**kwargs, decoder_attention_mask=mask, use_cache=False).logits
        encoder_outputs = model.get_encoder()(kwargs["input_ids"], kwargs["attention_mask"], kwargs["pixel_values"])
        source = encoder_outputs.last_hidden_state.shape[1]
        # A cross-attention cache with more slots than the encoder output, as a user may size it for any input.
        cache = EncoderDecoderCache(StaticCache(model.config, max_cache_len=8), StaticCache(model.config, source + 7))
        steps, ids = [], kwargs["decoder_input_ids"]
        for start, stop in ((0, 3), (3, 4), (4, 5)):  # a prompt of three tokens, then one token at a time
            out = model(encoder_outputs=encoder_outputs, decoder_input_ids=ids[:, start:stop], past_key_values=cache,
                        decoder_attention_mask=mask[:, :stop])  # fmt: skip
            steps.append(out.logits)
    attended = mask.bool()  # a pad's own logits attend nothing and are never read
    assert torch.allclose(torch.cat(steps, dim=1)[attended], whole[attended], atol=1e-5)


@pytest.mark.parametrize(
    "knobs",
    [{"exit_threshold": 0.5}, {"exit_policy": "confidence", "exit_threshold": 0.3, "exit_mode": "speculative"}],
    ids=["exits", "speculative"],
)
def test_a_static_cache_is_refused_with_decoder_exits_by_name(model, knobs):
    with pytest.raises(ValueError, match="cache_implementation='static'` serves the full decoder only"):
        model.generate(**tiny_inputs(batch=2), max_new_tokens=3, cache_implementation="static", **knobs)


def test_the_compiled_static_cache_decode_equals_eager():
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = tiny_model(decoder_layers=DECODER_LAYERS, encoder_layers=ENCODER_LAYERS).eval()
    compile_config = CompileConfig(fullgraph=True)  # the whole decoding step in one graph, no break
    compile_config._compile_all_devices = True  # Transformers compiles on GPUs only unless asked
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        eager = model.generate(**tiny_inputs(batch=3), max_new_tokens=6)
        compiled = [
            model.generate(**tiny_inputs(batch=3), max_new_tokens=6, cache_implementation="static",
                           compile_config=compile_config)
            for _ in range(2)
        ]  # fmt: skip
    assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled once, and every step reused it
    assert all(torch.equal(sequences, eager) for sequences in compiled)


@pytest.mark.parametrize("row_exit", ["keep", "compact"])
def test_layer_outputs_with_exits_hold_each_rows_exit_state_after_its_exit(row_exit):
    from hf_earlyexit.modeling.exit_controllers import FixedLayerExit

    model = tiny_model(decoder_layers=4, encoder_layers=3).eval()
    model.set_attn_implementation("eager")
    kwargs = {**teacher_forced(), "use_cache": False, "output_hidden_states": True, "output_attentions": True}
    depth = {"decoder": torch.tensor([1, 4]), "encoder": torch.tensor([2, 3])}
    controllers = {
        part: FixedLayerExit(lambda state, layers=layers: layers[state.rows]) for part, layers in depth.items()
    }
    with torch.no_grad():
        full = model(**kwargs)
        early = model(**kwargs, exit_settings=exit_settings(model, controllers, row_exit))
        encoder_only = {"encoder": controllers["encoder"]}  # the decoder reads what the encoder's exits gave
        decoder_full = model(**kwargs, exit_settings=exit_settings(model, encoder_only, row_exit))
    states, full_states = early.decoder_hidden_states, decoder_full.decoder_hidden_states
    assert len(states) == 5 and len(early.decoder_attentions) == 4 and early.exit_layers.tolist() == [1, 4]
    for layer in range(5):  # row 1 never exits: the full model's states; row 0 holds its layer-1 state from then on
        assert torch.allclose(states[layer][1], full_states[layer][1], atol=1e-5)
        assert torch.allclose(states[layer][0], full_states[min(layer, 1)][0], atol=1e-5)
    if row_exit == "compact":  # row 0 left the layers after layer 1: no attention there
        assert all(float(weights[0].abs().sum()) == 0 for weights in early.decoder_attentions[1:])
    assert all(float(weights[1].sum()) > 0 for weights in early.decoder_attentions)
    encoder_states, full_encoder = early.encoder_hidden_states, full.encoder_hidden_states
    assert len(encoder_states) == 4 and early.encoder_exit_layers[:, 0].tolist() == [2, 3]
    assert torch.allclose(encoder_states[3][0], full_encoder[2][0], atol=1e-5)  # row 0 stopped after layer 2
    assert torch.allclose(encoder_states[3][1], full_encoder[3][1], atol=1e-5)


def exit_settings(model, controllers: dict, row_exit: str):
    from hf_earlyexit.modeling.generation_early_exit import EarlyExitSettings

    return EarlyExitSettings.from_knobs(model.config, exit_controller=controllers, row_exit=row_exit)


def test_generate_returns_layer_outputs_with_exits(model):
    with torch.no_grad():
        out = model.generate(**tiny_inputs(batch=2), max_new_tokens=3, exit_policy="confidence", exit_threshold=0.2,
                             output_hidden_states=True, return_dict_in_generate=True)  # fmt: skip
    assert len(out.decoder_hidden_states) == out.exit_layers.shape[1]
    assert all(len(step) == DECODER_LAYERS + 1 for step in out.decoder_hidden_states)
