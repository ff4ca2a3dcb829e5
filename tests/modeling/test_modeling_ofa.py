"""The OFA backbone: parity with the official implementation, attention paths, caching, positions, loss."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from hf_earlyexit.convert import clean_state_dict, infer_config, load_converted_model
from hf_earlyexit.modeling.early_exit_cache import EarlyExitCache
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit
from hf_earlyexit.modeling.modeling_ofa import (
    causal_mask,
    image_relative_buckets,
    shift_tokens_right,
    token_relative_buckets,
)
from tests.helpers import tiny_inputs, tiny_model


def official_token_buckets(bucket_size: int, max_position: int) -> torch.Tensor:
    """`make_token_bucket_position` of the official OFA code, verbatim in substance: [max_position, max_position]."""
    context = torch.arange(max_position)[:, None]
    memory = torch.arange(max_position)[None, :]
    relative = context - memory
    sign = torch.sign(relative)
    mid = bucket_size // 2
    abs_pos = torch.where((relative < mid) & (relative > -mid), mid - 1, torch.abs(relative))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket = torch.where(abs_pos.le(mid), relative, log_pos.int() * sign).long()
    return bucket + bucket_size - 1


def official_image_buckets(bucket_size: int) -> torch.Tensor:
    """`make_image_bucket_position` of the official OFA code: [bucket_size^2 + 1, bucket_size^2 + 1]."""
    num_relative_distance = (2 * bucket_size - 1) ** 2 + 3
    coords = torch.stack(torch.meshgrid(torch.arange(bucket_size), torch.arange(bucket_size), indexing="ij"))
    flat = torch.flatten(coords, 1)
    relative = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
    relative[:, :, 0] += bucket_size - 1
    relative[:, :, 1] += bucket_size - 1
    relative[:, :, 0] *= 2 * bucket_size - 1
    index = torch.zeros((bucket_size * bucket_size + 1,) * 2, dtype=torch.long)
    index[1:, 1:] = relative.sum(-1)
    index[0, 0:] = num_relative_distance - 3
    index[0:, 0] = num_relative_distance - 2
    index[0, 0] = num_relative_distance - 1
    return index


def load_reference(fixture, attn_implementation: str) -> EarlyExitOFAForConditionalGeneration:
    state_dict = clean_state_dict(load_file(fixture / "model.safetensors"))
    config = infer_config(state_dict, json.loads((fixture / "config.json").read_text()))
    config._attn_implementation = attn_implementation
    return load_converted_model(state_dict, config)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_parity_with_official_implementation(reference_fixture, attn_implementation):
    model = load_reference(reference_fixture, attn_implementation)
    io = load_file(reference_fixture / "io.safetensors")
    with torch.no_grad():
        out = model(
            input_ids=io["input_ids"],
            pixel_values=io["patch_images"],
            decoder_input_ids=io["decoder_input_ids"],
            output_hidden_states=True,
        )
        encoder = model.get_encoder()(input_ids=io["input_ids"], pixel_values=io["patch_images"])
        resnet = model.encoder.embed_images(io["patch_images"])

    torch.testing.assert_close(out.logits, io["logits"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.encoder_last_hidden_state, io["encoder_last_hidden_state"], atol=5e-5, rtol=0)
    for i in range(3):
        torch.testing.assert_close(out.encoder_hidden_states[i], io[f"encoder_hidden_states.{i}"], atol=5e-5, rtol=0)
        torch.testing.assert_close(out.decoder_hidden_states[i], io[f"decoder_hidden_states.{i}"], atol=5e-5, rtol=0)
    torch.testing.assert_close(resnet, io["resnet_features"], atol=5e-5, rtol=0)
    assert torch.equal(encoder.padding_mask, io["encoder_padding_mask"])
    torch.testing.assert_close(encoder.position_embedding, io["encoder_position_embedding"], atol=1e-5, rtol=0)

    # The reference decodes 8 greedy steps without an EOS stop.
    generated = model.generate(
        input_ids=io["input_ids"],
        pixel_values=io["patch_images"],
        max_new_tokens=8,
        do_sample=False,
        forced_eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert generated.sequences[:, 1:].tolist() == io["greedy_tokens"].tolist()
    torch.testing.assert_close(torch.stack(generated.logits, dim=1), io["greedy_step_logits"], atol=1e-4, rtol=1e-4)


def test_relative_buckets_equal_official_index_tables():
    official = official_token_buckets(256, 1024)
    positions = torch.arange(1024)
    ours = token_relative_buckets(positions[:, None] - positions[None, :], 256, 1024)
    assert torch.equal(ours, official)
    assert ours[0, 0] == 255 and ours[1023, 0] == 510

    official_image = official_image_buckets(42)
    height, width = 5, 7  # patch (r, c) has id r * 42 + c + 1 in the official table
    ids = (torch.arange(height)[:, None] * 42 + torch.arange(width)[None, :] + 1).flatten()
    assert torch.equal(image_relative_buckets(height, width, 42, torch.device("cpu")), official_image[ids][:, ids])


@pytest.mark.parametrize("decomposed", [False, True])
def test_eager_equals_sdpa(decomposed):
    inputs = tiny_inputs()
    decoder_input_ids = torch.tensor([[0, 5, 9, 11], [0, 7, 7, 3]])
    outputs = []
    for implementation in ("eager", "sdpa"):
        model = tiny_model(attn_implementation=implementation, decompose_encoder_modalities=decomposed)
        with torch.no_grad():
            outputs.append(model(**inputs, decoder_input_ids=decoder_input_ids))
    torch.testing.assert_close(outputs[0].logits, outputs[1].logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        outputs[0].encoder_last_hidden_state, outputs[1].encoder_last_hidden_state, atol=1e-5, rtol=1e-5
    )


def test_set_attn_implementation_switches_paths():
    model = tiny_model(attn_implementation="eager")
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_a_registered_attention_function_runs_every_attention_of_the_model():
    """Attention goes through Transformers' `AttentionInterface`, so a user's kernel plugs in by name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counting_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append(type(module).__name__)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("counting_sdpa", counting_sdpa)
    inputs, decoder_input_ids = tiny_inputs(), torch.tensor([[0, 5, 9, 11], [0, 7, 7, 3]])
    model = tiny_model(attn_implementation="sdpa")
    with torch.no_grad():
        expected = model(**inputs, decoder_input_ids=decoder_input_ids).logits
        model.set_attn_implementation("counting_sdpa")
        counted = model(**inputs, decoder_input_ids=decoder_input_ids).logits
    config = model.config
    assert len(calls) == config.encoder_layers + 2 * config.decoder_layers  # self- and cross-attention per layer
    torch.testing.assert_close(counted, expected, rtol=0, atol=0)


def step_by_step_greedy(model, inputs, steps: int) -> torch.Tensor:
    """Greedy decoding by re-running the full prefix each step: no cache anywhere."""
    prefix = torch.zeros(inputs["input_ids"].shape[0], 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(**inputs, decoder_input_ids=prefix, use_cache=False).logits[:, -1]
            prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], dim=1)
    return prefix


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_cached_generation_equals_uncached(attn_implementation):
    model = tiny_model(attn_implementation=attn_implementation)
    inputs = tiny_inputs()
    settings = dict(max_new_tokens=8, min_new_tokens=8, forced_eos_token_id=None)
    cached = model.generate(**inputs, **settings)
    assert cached.tolist() == step_by_step_greedy(model, inputs, 8).tolist()
    assert cached.tolist() == model.generate(**inputs, **settings, use_cache=False).tolist()
    beams_cached = model.generate(**inputs, **settings, num_beams=3)
    assert beams_cached.tolist() == model.generate(**inputs, **settings, num_beams=3, use_cache=False).tolist()
    assert beams_cached.tolist() != cached.tolist()  # beam search really searched


def test_seeded_sampling_is_reproducible_with_and_without_cache():
    model = tiny_model()
    inputs = tiny_inputs()
    runs = []
    for use_cache in (True, False, True):
        torch.manual_seed(7)
        runs.append(model.generate(**inputs, do_sample=True, max_new_tokens=8, use_cache=use_cache).tolist())
    assert runs[0] == runs[1] == runs[2]


def test_cache_step_equals_full_prefix_logits():
    model = tiny_model()
    inputs = tiny_inputs()
    decoder_input_ids = torch.tensor([[0, 5, 9, 11, 4], [0, 7, 7, 3, 8]])
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        first = model(**inputs, decoder_input_ids=decoder_input_ids[:, :3], use_cache=True)
        rest = model(
            **inputs,
            decoder_input_ids=decoder_input_ids[:, 3:],
            past_key_values=first.past_key_values,
            use_cache=True,
        )
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_compacted_rows_return_every_layers_attentions(attn_implementation):
    """Under `row_exit="compact"` deeper layers run on the remaining rows only, reading the batch's cache by runs of
    rows: each layer's attentions must still come back as under `keep`, zeros for rows that stopped (under `keep`
    they run on with the batch, but their outputs are their exit's)."""
    depth = 4
    model = tiny_model(attn_implementation=attn_implementation, decoder_layers=depth, encoder_layers=3)
    inputs = tiny_inputs(batch=4, seed=4)
    # Rows exit at layers 1-4, varying by step, so a layer runs on non-contiguous rows (several runs) at some steps.
    exits = FixedLayerExit(lambda state: (state.rows + 2 * state.step) % depth + 1)
    outputs = {}
    for row_exit in ("keep", "compact"):
        with torch.no_grad():
            outputs[row_exit] = model.generate(
                **inputs, max_new_tokens=4, return_dict_in_generate=True, output_attentions=True,
                exit_controller=exits, kv_strategy="recompute", row_exit=row_exit,
            )  # fmt: skip
    kept, compacted = outputs["keep"], outputs["compact"]
    assert torch.equal(kept.sequences, compacted.sequences)
    for step, exit_layers in enumerate(compacted.exit_layers.T):
        for layer in range(depth):
            running = exit_layers > layer
            for name in ("decoder_attentions", "cross_attentions"):
                ours, theirs = getattr(compacted, name)[step][layer], getattr(kept, name)[step][layer]
                assert ours is not None, f"step {step}, layer {layer}: no {name}"
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
                assert not ours[~running].any() and theirs[running].any()


def test_decoding_from_the_position_table_equals_the_per_step_biases():
    """Without grad, decoding reads the position terms from a table: sliced without a decoder mask, gathered at
    each row's positions with one (mask holes shift the positions). It must equal computing them per step (with
    grad), in the first step, a cached step and after the weights change."""
    model = tiny_model()
    inputs = tiny_inputs()
    decoder_input_ids = torch.tensor([[0, 5, 9, 11, 4], [0, 7, 7, 3, 8]])
    ones = torch.ones_like(decoder_input_ids)

    def steps(grad: bool, mask: torch.Tensor | None) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            first = model(
                **inputs,
                decoder_input_ids=decoder_input_ids[:, :3],
                use_cache=True,
                decoder_attention_mask=None if mask is None else mask[:, :3],
            )
            rest = model(
                **inputs,
                decoder_input_ids=decoder_input_ids[:, 3:],
                use_cache=True,
                past_key_values=first.past_key_values,
                decoder_attention_mask=mask,
            )
        return torch.cat([first.logits, rest.logits], dim=1).detach()  # fmt: skip

    for change in (None, 0.25):
        if change is not None:
            with torch.no_grad():
                model.decoder.self_pos_k_linear.weight.add_(change)  # the table must follow the new weights
        table = steps(False, None)
        torch.testing.assert_close(table, steps(False, ones), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(table, steps(True, None), atol=1e-5, rtol=1e-5)
        holes = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 0, 1]])
        torch.testing.assert_close(steps(False, holes), steps(True, holes), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("start", "stop", "length"), [(4, 5, 5), (2, 5, 5), (4, 5, 9), (0, 1, 1)])
def test_the_causal_mask_of_slots_known_on_the_host_is_the_devices_or_none_where_it_hides_nothing(start, stop, length):
    on_device = causal_mask(torch.arange(start, stop), length, torch.device("cpu"))
    on_host = causal_mask(slice(start, stop), length, torch.device("cpu"))
    if on_host is None:  # one query at the last slot (a decoding step's): no key after it
        assert not bool(on_device.any())
    else:
        assert torch.equal(on_host, on_device) and bool(on_host.any())


def test_position_terms_of_several_steps_narrow_to_each_steps_own():
    """A speculative round computes the position terms of all its slots at once, and each draft step and the
    verification take their part (`DecoderStepBiases.narrowed`): each part must equal the terms computed for those
    queries alone, sliced from the table (no mask) and gathered at each row's positions (a mask with holes)."""
    model = tiny_model()
    decoder, inputs = model.get_decoder(), tiny_inputs()
    cache = EarlyExitCache(model.config, "recompute")
    start, count = 2, 4
    holes = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 1, 1, 0, 1, 1]])
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
        for mask in (None, holes):
            slots = start + count
            at_once = decoder.step_biases(start, count, slots, mask, encoder_outputs, cache)
            for first, queries in ((start, 1), (start + 1, 1), (start + 3, 1), (start + 1, 3)):
                length = first + queries
                own = decoder.step_biases(
                    first, queries, length, None if mask is None else mask[:, :length], encoder_outputs, cache
                )
                part = at_once.narrowed(first, queries, length)
                assert part.query_start == own.query_start == first
                for name in ("positions", "position_ids", "self_absolute", "buckets", "cross_bias", "query_mask"):
                    ours, theirs = getattr(part, name), getattr(own, name)
                    if theirs is None:
                        assert ours is None, name
                    else:
                        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=f"{name}, mask {mask}")
                passed = decoder.step_biases(first, queries, length, None, encoder_outputs, cache, computed=at_once)
                torch.testing.assert_close(passed.self_absolute, own.self_absolute, atol=1e-6, rtol=0)
            for first, queries, length in ((start - 1, 1, start), (start + 3, 2, slots + 1), (start, 1, slots + 1)):
                with pytest.raises(ValueError, match="position terms cover queries at slots 2..5"):
                    at_once.narrowed(first, queries, length)


def assert_decodes_alike(model, reference, inputs: dict, atol: float) -> None:
    """The same tokens and logits, greedy, from the full model and with every token leaving after layer 1 under
    `propagate` (whose fill of the skipped layers folds their projections)."""
    knobs = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        for extra in ({}, {"exit_controller": FixedLayerExit(1), "kv_strategy": "propagate"}):
            ours, expected = model.generate(**inputs, **knobs, **extra), reference.generate(**inputs, **knobs, **extra)
            assert torch.equal(ours.sequences, expected.sequences), extra
            torch.testing.assert_close(torch.stack(ours.logits), torch.stack(expected.logits), atol=atol, rtol=0)


def test_decoding_follows_the_weights_as_they_are_at_each_call():
    """What decoding derives from the weights (the position table, the stacked cross-attention and folded
    `propagate` projections) is made per call: weights written through `.data` (weight averaging, a merged adapter)
    take effect at the next call, as they do in a fresh copy."""
    model, other = tiny_model(decoder_layers=3), tiny_model(seed=7, decoder_layers=3)
    inputs = tiny_inputs()
    assert_decodes_alike(model, model, inputs, atol=0)  # derives from the old weights first
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.data.copy_(theirs.data)  # no version bump: only a per-call derivation sees it
    assert_decodes_alike(model, other, inputs, atol=0)


def test_an_encoder_output_passed_again_decodes_with_the_weights_of_the_call():
    model, inputs = tiny_model(decoder_layers=3), tiny_inputs()
    mask = inputs["attention_mask"]
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**{k: v for k, v in inputs.items() if k != "decoder_input_ids"})
        model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=4)  # keeps derived keys
        model.decoder.cross_pos_k_linear.weight.mul_(3)
        again = model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, max_new_tokens=4)
        fresh = model.generate(**inputs, max_new_tokens=4)
    assert torch.equal(again, fresh)


def test_hooked_and_adapted_projections_are_called_not_read():
    """A forward hook on a key/value projection (or an offload hook, or a LoRA layer) changes what the module gives,
    not its weights: decoding must call such modules, in the full model's cross-attention K/V and in `propagate`'s
    fill of skipped layers. A hook that doubles every projection equals weights doubled in a copy."""
    model, baked = tiny_model(decoder_layers=3), tiny_model(decoder_layers=3)
    inputs = tiny_inputs()
    for layer, baked_layer in zip(model.decoder.layers, baked.decoder.layers, strict=True):
        for name in ("k_proj", "v_proj"):
            for attention, baked_attention in ((layer.self_attn, baked_layer.self_attn),
                                               (layer.cross_attn, baked_layer.cross_attn)):  # fmt: skip
                getattr(attention, name).register_forward_hook(lambda module, args, output: 2 * output)
                with torch.no_grad():
                    getattr(baked_attention, name).weight.mul_(2)
                    getattr(baked_attention, name).bias.mul_(2)
    assert_decodes_alike(model, baked, inputs, atol=1e-5)


def test_lora_on_the_key_value_projections_decodes_like_the_merged_model():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model(decoder_layers=3),
        peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    merged = copy.deepcopy(model).merge_and_unload()  # the same adapters, merged into plain linear layers
    assert_decodes_alike(model, merged, tiny_inputs(), atol=1e-4)


def test_a_model_offloaded_by_accelerate_decodes_like_the_loaded_one(tmp_path):
    """`device_map="auto"` beyond the memory given offloads weights to disk, loaded by hooks as each module runs: no
    weight may be read outside its module's call, in any mode."""
    pytest.importorskip("accelerate")
    model = tiny_model(decoder_layers=3).eval()
    model.save_pretrained(tmp_path / "model")
    offloaded = EarlyExitOFAForConditionalGeneration.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": "150KB"}, offload_folder=tmp_path / "offload"
    ).eval()
    assert "disk" in set(offloaded.hf_device_map.values())
    inputs = tiny_inputs()
    modes = (
        {},
        {"exit_controller": FixedLayerExit(1), "kv_strategy": "propagate"},
        {"exit_controller": FixedLayerExit(2), "kv_strategy": "recompute", "num_beams": 2},
        {"exit_threshold": 0.5, "exit_policy": "confidence", "exit_mode": "speculative"},
    )
    with torch.no_grad():
        for knobs in modes:
            expected = model.generate(**inputs, max_new_tokens=5, **knobs)
            assert torch.equal(offloaded.generate(**inputs, max_new_tokens=5, **knobs), expected), knobs


def test_left_and_right_padding_give_the_unpadded_result():
    model = tiny_model()
    inputs = tiny_inputs(batch=1, pad_last=0)
    decoder_input_ids = torch.tensor([[0, 5, 9]])
    pixel_values = inputs["pixel_values"]
    ids = inputs["input_ids"]
    pads = torch.ones(1, 3, dtype=torch.long)
    padded = {
        "right": (torch.cat([ids, pads], 1), torch.cat([torch.ones_like(ids), 0 * pads], 1)),
        "left": (torch.cat([pads, ids], 1), torch.cat([0 * pads, torch.ones_like(ids)], 1)),
    }
    with torch.no_grad():
        reference = model(input_ids=ids, pixel_values=pixel_values, decoder_input_ids=decoder_input_ids).logits
        for padded_ids, mask in padded.values():
            logits = model(
                input_ids=padded_ids,
                attention_mask=mask,
                pixel_values=pixel_values,
                decoder_input_ids=decoder_input_ids,
            ).logits
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_decomposed_encoder_runs_each_modality_on_its_own():
    model = tiny_model(decompose_encoder_modalities=True, decomposed_image_relative_bias=True)
    inputs = tiny_inputs()
    with torch.no_grad():
        joint_streams = model.encoder(**inputs).last_hidden_state
        image_only = model.encoder(pixel_values=inputs["pixel_values"]).last_hidden_state
        text_only = model.encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        model.config.decompose_encoder_modalities = False
        fused = model.encoder(**inputs).last_hidden_state
    torch.testing.assert_close(
        joint_streams, torch.cat([image_only, text_only.last_hidden_state], 1), atol=1e-5, rtol=0
    )
    assert not torch.allclose(joint_streams, fused, atol=1e-3)  # the fused encoder attends across modalities


def test_a_decomposed_encoder_gives_each_layers_attentions_over_the_whole_sequence():
    """Each stream's own attentions, on the diagonal; between the streams, which never attend to each other, zeros."""
    model = tiny_model(decompose_encoder_modalities=True).eval()
    inputs = tiny_inputs()
    with torch.no_grad():
        out = model(**inputs, decoder_input_ids=torch.zeros(2, 1, dtype=torch.long), output_attentions=True)
        image = model.encoder(pixel_values=inputs["pixel_values"], output_attentions=True).attentions
        text = model.encoder(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], output_attentions=True
        )
    n, length = image[0].shape[-1], out.encoder_last_hidden_state.shape[1]
    assert len(out.encoder_attentions) == model.config.encoder_layers and out.cross_attentions is not None
    for layer, weights in enumerate(out.encoder_attentions):
        assert weights.shape == (2, model.config.encoder_attention_heads, length, length)
        torch.testing.assert_close(weights[..., :n, :n], image[layer], atol=1e-6, rtol=0)
        torch.testing.assert_close(weights[..., n:, n:], text.attentions[layer], atol=1e-6, rtol=0)
        assert not weights[..., :n, n:].any() and not weights[..., n:, :n].any()


def test_official_mue_image_stream_has_no_relative_bias():
    """decomposed_image_relative_bias=False (the official MuE code) ignores the image relative tables."""
    model = tiny_model(decompose_encoder_modalities=True)
    pixel_values = tiny_inputs()["pixel_values"]
    with torch.no_grad():
        before = model.encoder(pixel_values=pixel_values).last_hidden_state
        for table in model.encoder.image_rel_pos_table_list:
            table.weight.normal_()
        after = model.encoder(pixel_values=pixel_values).last_hidden_state
    assert torch.equal(before, after)


def test_labels_give_the_cross_entropy_of_shifted_targets():
    model = tiny_model()
    inputs = tiny_inputs()
    labels = torch.tensor([[5, 9, 11, 2], [7, 3, -100, -100]])
    out = model(**inputs, labels=labels)
    decoder_input_ids = shift_tokens_right(labels, pad_token_id=1, decoder_start_token_id=0)
    assert decoder_input_ids.tolist() == [[0, 5, 9, 11], [0, 7, 3, 1]]
    logits = model(**inputs, decoder_input_ids=decoder_input_ids).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    assert model.encoder.embed_images.conv1.weight.grad.abs().sum() > 0  # gradients reach the image stem


def test_tied_embeddings_are_one_parameter():
    model = tiny_model()
    assert model.encoder.embed_tokens.weight is model.decoder.embed_tokens.weight
    assert model.encoder.embed_tokens.weight is model.decoder.output_projection.weight


def test_drop_path_drops_whole_samples():
    model = tiny_model(encoder_drop_path_rate=0.9, decoder_drop_path_rate=0.9).train()
    layer = model.encoder.layers[-1]
    torch.manual_seed(0)
    x = torch.randn(64, 5, 32)
    branch = layer.drop_path(torch.ones_like(x))
    per_sample = branch.flatten(1)
    assert torch.all(per_sample == per_sample[:, :1])  # every token of a sample is kept or dropped together
    assert (per_sample[:, 0] == 0).any() and (per_sample[:, 0] > 0).any()


@pytest.mark.parametrize(("preset", "millions"), [("tiny", 33.5), ("base", 182.2), ("huge", 929.5)])
def test_presets_have_the_published_sizes(preset, millions):
    with torch.device("meta"):
        model = EarlyExitOFAForConditionalGeneration(OFAEarlyExitConfig.from_preset(preset))
    assert model.num_parameters() / 1e6 == pytest.approx(millions, abs=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 100}, "d_model"),
        ({"resnet_type": "resnet34"}, "resnet_type"),
        ({"encoder_layers": -1}, "encoder_layers"),
        ({"decoder_attention_heads": 0}, "decoder_attention_heads"),
        ({"dropout": 1.5}, "dropout"),
        ({"activation_function": "swishy"}, "activation_function"),
        ({"encoder_normalize_before": False}, "encoder_normalize_before"),
        ({"entangle_position_embedding": True}, "entangle_position_embedding"),
    ],
)
def test_config_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        OFAEarlyExitConfig(**overrides)


def test_inputs_longer_than_the_positions_are_refused_by_name():
    model = tiny_model(max_position_embeddings=12, token_bucket_size=8)
    inputs = tiny_inputs(batch=1, text_length=12)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=12, min_new_tokens=12)  # fed: the start and 11 new, 12 positions
        with pytest.raises(ValueError, match="decoder's tokens .* reach 13 positions.*max_position_embeddings"):
            model(**inputs, decoder_input_ids=torch.zeros(1, 13, dtype=torch.long))
        long = tiny_inputs(batch=1, text_length=13)
        with pytest.raises(ValueError, match="text input has 13 positions.*max_position_embeddings"):
            model.generate(**long, max_new_tokens=2)


def test_unknown_preset_is_an_error():
    with pytest.raises(ValueError, match="preset"):
        OFAEarlyExitConfig.from_preset("gigantic")


def test_bad_forward_inputs_are_clear_errors():
    model = tiny_model()
    inputs = tiny_inputs()
    with pytest.raises(ValueError, match="pixel_values"):
        model(input_ids=inputs["input_ids"], pixel_values=torch.zeros(2, 64, 64), decoder_input_ids=inputs["input_ids"])
    with pytest.raises(ValueError, match="image_bucket_size"):
        model(**{**inputs, "pixel_values": torch.zeros(2, 3, 16 * 43, 16)}, decoder_input_ids=inputs["input_ids"])
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(**inputs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda inputs: {"pixel_values": inputs["pixel_values"][:1]}, "`pixel_values` has 1 images for 3 rows"),
        (lambda inputs: {"attention_mask": inputs["attention_mask"][:2]}, "`attention_mask` must have the text's"),
        (lambda inputs: {"input_ids": inputs["input_ids"][:, :0], "attention_mask": None}, "has no token"),
        (lambda inputs: {"pixel_values": torch.randn(3, 3, 15, 15)}, "smaller than one 16 px patch"),
    ],
)
def test_encoder_inputs_that_disagree_are_refused_by_name(change, message):
    """They failed deep in the model (a shape RuntimeError, an empty argmax, a convolution's kernel error)."""
    inputs = tiny_inputs(batch=3)
    with pytest.raises(ValueError, match=message):
        tiny_model().generate(**{**inputs, **change(inputs)}, max_new_tokens=2)


def test_layerdrop_skips_the_same_layers_in_both_encoder_streams():
    model = tiny_model(decompose_encoder_modalities=True, encoder_layerdrop=0.5, decoder_layerdrop=0.5).train()
    inputs = tiny_inputs()
    depths = set()
    for seed in range(6):
        torch.manual_seed(seed)
        out = model(**inputs, labels=torch.tensor([[5, 2], [7, 2]]), output_hidden_states=True)
        assert torch.isfinite(out.loss)
        depths.add(len(out.encoder_hidden_states))
    assert len(depths) > 1  # layers were really dropped, and the two streams always agreed on which


@pytest.mark.parametrize(
    ("knobs", "name"),
    [({"exit_threshold": 0.5}, "decoder_layerdrop"), ({"encoder_image_exit_threshold": 0.5}, "encoder_layerdrop")],
)
def test_exits_in_training_mode_with_layerdrop_are_refused_by_name(knobs, name):
    """Exits test and count the layers in order: a decoder exit asked after a dropped layer failed with KeyError."""
    model = tiny_model(decompose_encoder_modalities=True, encoder_layerdrop=0.5, decoder_layerdrop=0.5).train()
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=f"`{name}=0.5` drops layers at random in training mode: call `model.eval"):
        model.generate(**tiny_inputs(), **knobs, max_new_tokens=3)
    model.eval().generate(**tiny_inputs(), **knobs, max_new_tokens=3)


def test_get_encoder_takes_the_base_class_modality():
    model = tiny_model()
    assert model.get_encoder() is model.get_encoder(modality="image") is model.get_encoder("text") is model.encoder
    with pytest.raises(ValueError, match="not 'audio'"):
        model.get_encoder(modality="audio")


def teacher_forced(batch: int, decoder_length: int, seed: int = 0) -> dict:
    inputs = tiny_inputs(batch=batch, text_length=5 + batch, seed=seed)
    decoder = torch.randint(3, 100, (batch, decoder_length), generator=torch.Generator().manual_seed(seed))
    return {**inputs, "decoder_input_ids": decoder, "use_cache": False}


@pytest.mark.parametrize(("grad", "decompose"), [(False, False), (True, False), (False, True)])
def test_the_full_model_exports_with_static_and_dynamic_shapes(grad, decompose):
    """Also with MuE's decomposed encoder, whose text stream leaves its pads out only when it has some."""
    from torch.export import Dim

    model = tiny_model(decoder_layers=3, decompose_encoder_modalities=decompose).eval()
    kwargs = teacher_forced(2, 4)
    batch, text, decoder = Dim("batch", min=1, max=16), Dim("text", min=2, max=64), Dim("decoder", min=2, max=64)
    dynamic = {name: None for name in kwargs} | {
        "input_ids": {0: batch, 1: text}, "attention_mask": {0: batch, 1: text}, "pixel_values": {0: batch},
        "decoder_input_ids": {0: batch, 1: decoder},
    }  # fmt: skip
    with torch.set_grad_enabled(grad):
        static = torch.export.export(model, (), kwargs=kwargs).module()
        flexible = torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic).module()
        other = teacher_forced(3, 6, seed=1)
        assert torch.allclose(static(**kwargs).logits, model(**kwargs).logits, atol=1e-4)
        assert torch.allclose(flexible(**other).logits, model(**other).logits, atol=1e-4)


def test_the_compiled_forward_equals_eager():
    model = tiny_model(decoder_layers=3).eval()
    compiled = torch.compile(model)
    kwargs = teacher_forced(2, 4)
    with torch.no_grad():
        assert torch.allclose(compiled(**kwargs).logits, model(**kwargs).logits, atol=1e-4)


def test_embeddings_in_place_of_token_ids_give_the_same_outputs():
    model = tiny_model(decoder_layers=3).eval()
    kwargs = teacher_forced(2, 4)
    embed = model.get_input_embeddings()
    as_embeddings = {
        **{name: value for name, value in kwargs.items() if name not in ("input_ids", "decoder_input_ids")},
        "inputs_embeds": embed(kwargs["input_ids"]),
        "decoder_inputs_embeds": embed(kwargs["decoder_input_ids"]),
    }
    with torch.no_grad():
        assert torch.allclose(model(**as_embeddings).logits, model(**kwargs).logits, atol=1e-5)
        for knobs in ({"exit_threshold": None}, {"exit_policy": "confidence", "exit_threshold": 0.2}):
            inputs = tiny_inputs(batch=2)
            by_ids = model.generate(**inputs, max_new_tokens=5, **knobs, return_dict_in_generate=True)
            embeddings = embed(inputs.pop("input_ids"))
            by_embeddings = model.generate(
                **inputs, inputs_embeds=embeddings, max_new_tokens=5, **knobs, return_dict_in_generate=True
            )
            assert torch.equal(by_embeddings.sequences, by_ids.sequences)
            assert torch.equal(by_embeddings.exit_layers, by_ids.exit_layers)
    with pytest.raises(ValueError, match="either `input_ids` or `inputs_embeds`"):
        model(**kwargs, inputs_embeds=as_embeddings["inputs_embeds"])
    with pytest.raises(ValueError, match="either `decoder_input_ids` or `decoder_inputs_embeds`"):
        model(**kwargs, decoder_inputs_embeds=as_embeddings["decoder_inputs_embeds"])


def test_encoder_outputs_other_than_the_encoders_own_are_refused_by_name():
    model = tiny_model()
    inputs = tiny_inputs()
    hidden = model.get_encoder()(**inputs).last_hidden_state
    with pytest.raises(ValueError, match="`encoder_outputs` must be the OFAEncoderOutput .* got tuple"):
        model(encoder_outputs=(hidden,), decoder_input_ids=torch.tensor([[0], [0]]))
