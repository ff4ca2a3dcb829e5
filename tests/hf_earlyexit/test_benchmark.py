"""The benchmark's ideal (a model truncated to K layers is exactly the full model forced to exit after K) and its
clock (settings paired batch by batch)."""

import sys

import pytest
import torch

from hf_earlyexit import ConfidenceExit, EarlyExitSettings, FixedLayerExit, benchmark
from hf_earlyexit.benchmark import (
    checked_device,
    device_name,
    exit_patterns,
    model_benchmark,
    paired_seconds,
    per_row_exit,
    timed_on,
    truncated_model,
)
from hf_earlyexit.modeling import row_exits
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


@pytest.mark.parametrize("row_exit", ["keep", "compact"])
def test_each_pattern_row_exits_at_its_layer_under_either_plan(row_exit):
    model = tiny_model(decoder_layers=4)
    patterns = exit_patterns(1, 4, 4)
    assert {name: layers.tolist() for name, layers in patterns.items()} == {
        "alternating": [1, 4, 1, 4], "one_row_deep": [4, 1, 1, 1], "each_row_own_layer": [1, 2, 3, 1]
    }  # fmt: skip
    with torch.no_grad():
        for layers in patterns.values():  # compaction renumbers no row: the lookup follows the rows that go on
            out = model.generate(
                **tiny_inputs(batch=4, pad_last=0),
                max_new_tokens=3,
                min_new_tokens=3,
                exit_controller=per_row_exit(layers),
                row_exit=row_exit,
                return_dict_in_generate=True,
            )
            assert out.exit_layers.tolist() == [[layer] * 3 for layer in layers.tolist()]
    assert exit_patterns(1, 4, 1) == {}  # at batch 1 every pattern is a uniform exit


def test_ask_only_pays_each_test_and_stops_nothing():
    model, inputs = tiny_model(decoder_layers=4), tiny_inputs(batch=3)
    tested = []

    class Recorder(ConfidenceExit):
        def __call__(self, state):
            tested.append(state.layer)
            return super().__call__(state)

    asking = model.generate(
        **inputs, max_new_tokens=5, exit_controller=benchmark.AskOnly(Recorder(0.0)), return_dict_in_generate=True
    )
    full = model.generate(**inputs, max_new_tokens=5, return_dict_in_generate=True)
    assert torch.equal(asking.sequences, full.sequences) and bool(
        (asking.exit_layers[asking.exit_layers > 0] == 4).all()
    )
    assert set(tested) == {1, 2, 3}  # a threshold of 0 would stop every row at layer 1: AskOnly stops none


def test_paired_seconds_alternates_settings_per_batch_and_sums_the_batch_medians(monkeypatch):
    clock, calls = [0.0], []
    # Seconds per (setting, batch) in rounds 0 (warm-up), 1, 2, 3: a spike in one round must not count.
    durations = {
        ("full", 0): [9, 2, 2, 50],
        ("full", 1): [9, 3, 4, 4],
        ("exit", 0): [9, 1, 1, 1],
        ("exit", 1): [9, 2, 2, 3],
    }
    monkeypatch.setattr(row_exits.time, "perf_counter", lambda: clock[0])  # the clock of every timed round

    def timed(name):
        def run(index):
            calls.append((name, index))
            clock[0] += durations[name, index][sum(call == (name, index) for call in calls) - 1]

        return run

    seconds = paired_seconds({"full": timed("full"), "exit": timed("exit")}, 2, 3, torch.device("cpu"))
    assert seconds == {"full": 2 + 4, "exit": 1 + 2}
    one_batch = [("exit", 0), ("full", 0), ("full", 0), ("exit", 0), ("exit", 0), ("full", 0), ("full", 0), ("exit", 0)]
    assert calls[:8] == one_batch and calls[8:] == [(name, 1) for name, _ in one_batch]
    with pytest.raises(ValueError, match="`repeats` must be positive"):
        paired_seconds({"full": timed("full")}, 1, 0, torch.device("cpu"))


def test_checked_device_refuses_a_malformed_or_absent_device():
    assert checked_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="must name a torch device .* got 'gpu0'"):
        checked_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"Device cuda: this machine has the CPU alone \(no accelerator\)\."):
            checked_device("cuda")
    for name in ("meta", "mps" if torch.cuda.is_available() else "xpu"):  # were a RuntimeError deep in the model
        with pytest.raises(ValueError, match=f"Device {name}: this machine has"):
            checked_device(name)


def test_a_timing_names_its_device_as_a_record_shows_it():
    assert device_name(torch.device("cpu")) == f"cpu ({torch.get_num_threads()} threads)"
    assert device_name(torch.device("mps")) == "mps" and device_name(torch.device("xpu", 1)) == "xpu:1"  # not "cpu"
    cpu = device_name(torch.device("cpu"))
    assert timed_on(tiny_model().to(torch.bfloat16)) == {"device": cpu, "dtype": "bfloat16"}


def test_a_bad_dtype_device_or_count_is_named_before_any_work():
    from hf_earlyexit.benchmark import forced_exit_benchmark

    for kwargs, message in (
        ({"dtype": "float33"}, "`dtype` must be one of"),
        ({"device": "cpux"}, "must name a torch device"),
        ({"batch_sizes": (0,)}, "must be positive"),
        # `generate` stops at the decoder's positions: ms per token were divided by tokens never decoded.
        ({"new_tokens": 1025}, r"`--new-tokens` must be at most 1024 for OFA-tiny"),
    ):
        with pytest.raises(ValueError, match=message):
            forced_exit_benchmark(2, preset="tiny", **kwargs)
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        model_benchmark(tiny_model(), None, "vqa", {"exit_threshold": 0.5}, dtype="half")


def test_model_benchmark_needs_an_exit_setting():
    with pytest.raises(ValueError, match="No exit setting"):
        model_benchmark(tiny_model(), None, "vqa", {"kv_strategy": "copy"})


def test_where_a_round_goes_is_profiled_without_the_profilers_own_lines(capfd):
    """Kineto printed `profiler_start` / `profiler_stop` from C++ into `bench` and `demo` reports."""
    from hf_earlyexit.evaluation import run_knobs, task_inputs
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, load_model_and_processor

    model, processor = load_model_and_processor(EMBEDDED_MODEL_DIR)
    inputs = task_inputs("caption", processor, "test", 2, 2)
    capfd.readouterr()
    shares = benchmark.round_time_shares(model, processor, inputs, run_knobs(model, exit_mode="speculative"), 2)
    assert sum(shares[part] for part in ("draft", "verification", "bookkeeping")) == pytest.approx(1, abs=0.01)
    assert "profiler" not in capfd.readouterr().err
    print("still written", file=sys.stderr)  # the process's standard error is back
    assert "still written" in capfd.readouterr().err


def test_the_bench_times_the_part_costs_in_the_rounds_it_prices(monkeypatch):
    from hf_earlyexit.evaluation import task_inputs
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, load_model_and_processor
    from hf_earlyexit.modeling.exit_knobs import NO_EXIT

    model, processor = load_model_and_processor(EMBEDDED_MODEL_DIR)
    inputs = task_inputs("caption", processor, "test", 6, 3)
    rounds = []
    # Seconds over the batches as if measured: the encoder 10 s, 4 s with its image stream stopped after layer 1
    # and 7 s with its text stream, 11 s asking the text stream after every layer; the decoder 20 s at full depth,
    # 8 s and 18 s forced to stop after its first and last exit point (layers 1 and 5), 23 s asking after every one.
    timed = {"encoder": 10.0, "encoder_image": 4.0, "encoder_text": 7.0, "decoder": 20.0, "decoder_shallow": 8.0}
    timed["decoder_deep"] = 18.0
    timed |= {"encoder_text asking": 11.0, "decoder asking confidence": 23.0, "full": 3.0, "early_exit": 2.0}

    def paired(functions, batches, repeats, device, progress=None):
        rounds.append((set(functions), batches))
        for index in range(batches):
            for function in functions.values():
                function(index)
        return {name: timed[name.removeprefix("part cost: ")] for name in functions}

    monkeypatch.setattr(benchmark, "paired_seconds", paired)
    knobs = {"exit_threshold": 0.8, "exit_policy": "confidence", "encoder_text_exit_threshold": 0.9}
    knobs["encoder_min_exit_layer"] = 2
    report = benchmark.task_benchmark(model, processor, inputs, knobs, repeats=1, round_shares=False)
    parts = {"encoder", "encoder_image", "encoder_text", "encoder_text asking", "decoder", "decoder_shallow"}
    parts |= {"decoder_deep", "decoder asking confidence"}
    assert rounds == [({"full", "early_exit"} | {f"part cost: {part}" for part in parts}, 2)]  # one set of rounds
    config, decoding = model.config, {**NO_EXIT, "max_new_tokens": inputs.task.max_new_tokens}
    # The decoder is priced at the full model's own lengths, not at `max_new_tokens` (captions end sooner).
    tokens = sum(3 * (model.generate(**batch, **decoding).shape[1] - 1) for batch in inputs.batches)
    assert tokens < 6 * inputs.task.max_new_tokens
    costs = report["per_part_seconds"]
    assert costs["encoder_image_layer_per_sample"] == pytest.approx(6 / (config.encoder_layers - 1) / 6)
    assert costs["encoder_text_layer_per_sample"] == pytest.approx(3 / (config.encoder_layers - 1) / 6)
    # A layer is priced between the two forced exits, which both pay the exit path: 10 s over layers 2 to 5. The
    # full model's step is the rest of its 20 s (5 s); the exit path, what the first exit's 8 s hold beyond its
    # layer and that rest (0.5 s).
    assert config.exit_points[0] == 1 and config.exit_points[-1] == config.decoder_layers - 1 == 5
    assert costs["decoder_layer_per_token"] == pytest.approx(2.5 / tokens)
    assert costs["decoder_fixed_per_token"] == pytest.approx(5 / tokens)
    assert costs["decoder_exit_path_per_token"] == pytest.approx(0.5 / tokens)
    assert costs["decoder_ask_per_token"] == pytest.approx(3 / (tokens * len(config.exit_points)))
    assert costs["encoder_ask_per_sample"] == {"encoder_text": pytest.approx(1 / (config.encoder_layers - 1) / 6)}
    assert costs["encoder_layers_asked"] == {"encoder_text": list(range(2, config.encoder_layers))}
    assert report["wall_clock_time_reduction"] == pytest.approx(1 / 3, abs=1e-4)


def test_the_call_cost_is_what_the_full_models_seconds_hold_beyond_its_parts(monkeypatch):
    """`call_fixed` comes from the full model's whole calls, timed with the parts, in `bench` and in `calibrate`'s
    `measure_part_costs` alike (calibrate's time reductions left it out)."""
    from hf_earlyexit.evaluation import task_inputs
    from hf_earlyexit.loading import EMBEDDED_MODEL_DIR, load_model_and_processor
    from hf_earlyexit.measures import full_depth_cost

    model, processor = load_model_and_processor(EMBEDDED_MODEL_DIR)
    inputs, config = task_inputs("vqa", processor, "test", 4, 2), model.config
    timed = {"encoder": 10.0, "encoder_image": 4.0, "encoder_text": 7.0, "decoder": 20.0, "decoder_shallow": 8.0}
    timed["decoder_deep"] = 18.0

    def measured(full: float) -> float:
        def paired(functions, batches, repeats, device, progress=None):
            assert "full" in functions  # timed in the same rounds as the parts
            return {name: {**timed, "full": full}[name.removeprefix("part cost: ")] for name in functions}

        monkeypatch.setattr(benchmark, "paired_seconds", paired)
        return benchmark.measure_part_costs(model, processor, inputs, repeats=1, samples=4)

    parts = measured(0.0)
    runs = benchmark.PartCostRuns(model, inputs)
    tokens = sum(len(batch["input_ids"]) * length for batch, length in zip(inputs.batches, runs.lengths, strict=True))
    explained = full_depth_cost(parts, 4, tokens, config.encoder_layers, config.decoder_layers)
    assert parts.call_fixed == 0  # the parts explain more than the calls took
    assert measured(explained + 4 * 3.0).call_fixed == pytest.approx(3.0)  # 3 s per sample beyond the parts
