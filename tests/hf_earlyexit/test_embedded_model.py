"""The model that ships inside the package: small enough, complete, calibrated, and its remote code is the
package's own."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoProcessor

from hf_earlyexit.evaluation import task_inputs
from hf_earlyexit.loading import EMBEDDED_MODEL_DIR
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit
from hf_earlyexit.modeling.exit_knobs import NO_EXIT
from hf_earlyexit.tasks import get_task

MODELING = Path(__file__).resolve().parents[2] / "modeling"


def test_it_is_under_25_mb_with_tokenizer_processor_card_calibration_and_benchmark():
    files = {path.name for path in EMBEDDED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "processor_config.json"} <= files
    assert {"tokenizer.json", "README.md", "calibration.json", "training_recipe.json", "benchmark.jsonl"} <= files
    assert sum(path.stat().st_size for path in EMBEDDED_MODEL_DIR.iterdir()) <= 25 * 2**20
    assert "training_args.bin" not in files  # no pickles in the package


def test_its_remote_code_is_the_packages_modeling_code():
    shipped = sorted(path.name for path in EMBEDDED_MODEL_DIR.glob("*.py"))
    assert "modeling_ofa.py" in shipped
    for name in shipped:
        assert (EMBEDDED_MODEL_DIR / name).read_text() == (MODELING / name).read_text(), name


def test_it_loads_as_remote_code_and_exits_early_by_default():
    model = AutoModel.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True).eval()
    processor = AutoProcessor.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True)
    knobs = ("exit_threshold", "encoder_image_exit_threshold", "encoder_text_exit_threshold")
    assert any(getattr(model.generation_config, knob, None) is not None for knob in knobs)  # calibrated defaults
    rows = get_task("caption").dataset("test", size=4)
    inputs = processor(images=list(rows["image"]), text=list(rows["prompt"]), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, return_dict_in_generate=True)
    decoder_layers = out.exit_layers[out.exit_layers > 0].float().mean()
    encoder_layers = out.encoder_exit_layers.float().mean()
    assert decoder_layers < model.config.decoder_layers or encoder_layers < model.config.encoder_layers
    captions = processor.batch_decode(out.sequences, skip_special_tokens=True)
    assert all(len(caption.split()) >= 4 for caption in captions)


def test_it_publishes_as_a_hub_folder_whose_card_holds_its_benchmark(tmp_path):
    from huggingface_hub import ModelCard

    from hf_earlyexit.publishing import publish, read_benchmark

    published = publish(EMBEDDED_MODEL_DIR, "someone/ofa-ee-small", dry_run=True, output_dir=tmp_path / "hub")
    assert published.validation["hf_earlyexit_imported"] is False
    card = ModelCard.load(published.folder / "README.md").text
    for record in read_benchmark(EMBEDDED_MODEL_DIR / "benchmark.jsonl"):
        assert f"| {record['task']} | {record['metric']} | {record['full']['quality']:.3f} |" in card
    assert "![Quality against expected time reduction](tradeoff.png)" in card
    assert (published.folder / "tradeoff.png").is_file()


# --- on a GPU (run where one is lent; CI has none) -------------------------------------------------------------------

GPU = "cuda"
on_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (these run where a GPU is lent)")


@pytest.fixture(scope="module")
def gpu_model():
    model = AutoModel.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True).eval()
    return model.to(GPU), AutoProcessor.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True)


def gpu_batch(processor, task: str, size: int) -> dict:
    return task_inputs(task, processor, "test", size, size, GPU).batches[0]


@torch.no_grad()
def greedy(model, inputs, **knobs):
    return model.generate(**inputs, max_new_tokens=24, do_sample=False, return_dict_in_generate=True, **knobs)


@on_a_gpu
def test_on_a_gpu_the_full_model_gives_the_cpus_tokens_and_never_firing_exits_the_full_models(gpu_model):
    model, processor = gpu_model
    on_cpu = AutoModel.from_pretrained(EMBEDDED_MODEL_DIR, trust_remote_code=True).eval()
    for task in ("caption", "vqa"):  # VQA's questions pad the batch
        inputs = gpu_batch(processor, task, 8)
        full = greedy(model, inputs, **NO_EXIT).sequences
        assert torch.equal(full.cpu(), greedy(on_cpu, {k: v.cpu() for k, v in inputs.items()}, **NO_EXIT).sequences)
        assert torch.equal(greedy(model, inputs, **{**NO_EXIT, "exit_threshold": 1.0}).sequences, full)


@on_a_gpu
@pytest.mark.parametrize("draft_tokens", [1, 4, 8])
def test_on_a_gpu_speculative_mode_gives_the_full_models_tokens(gpu_model, draft_tokens):
    model, processor = gpu_model
    for task, size in (("caption", 1), ("caption", 8), ("vqa", 8)):
        inputs = gpu_batch(processor, task, size)
        full = greedy(model, inputs, **NO_EXIT).sequences
        for controller in (None, FixedLayerExit(2)):  # the calibrated drafts, and a fixed layer
            knobs = {} if controller is None else {"exit_controller": controller}
            out = greedy(model, inputs, exit_mode="speculative", num_assistant_tokens=draft_tokens, **knobs)
            assert torch.equal(out.sequences, full) and int(out.accepted_tokens.sum()) > 0


@on_a_gpu
@pytest.mark.parametrize("beams", [1, 3])
def test_on_a_gpu_keep_and_compact_agree_under_recompute(gpu_model, beams):
    model, processor = gpu_model
    depth = model.config.decoder_layers
    for task in ("caption", "vqa"):
        inputs = gpu_batch(processor, task, 4)
        runs = [
            greedy(model, inputs, exit_controller=FixedLayerExit(lambda s: (s.rows + 2 * s.step) % depth + 1),
                   kv_strategy="recompute", row_exit=plan, num_beams=beams)
            for plan in ("keep", "compact")
        ]  # fmt: skip
        assert torch.equal(runs[0].sequences, runs[1].sequences)
        assert torch.equal(runs[0].exit_layers, runs[1].exit_layers)
        assert len(set(runs[0].exit_layers.flatten().tolist())) > 3  # rows exit at scattered layers
