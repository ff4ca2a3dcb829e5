"""save_pretrained -> from_pretrained: in-process, as remote code without hf_earlyexit, and through Auto classes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_earlyexit import EarlyExitOFAForConditionalGeneration
from tests.helpers import tiny_inputs, tiny_model

GENERATE = dict(max_new_tokens=6, num_beams=3)


def test_save_writes_remote_code_and_auto_map(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "modeling_ofa.py", "configuration_ofa.py"} <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_ofa.OFAEarlyExitConfig",
        "AutoModel": "modeling_ofa.EarlyExitOFAForConditionalGeneration",
        "AutoModelForSeq2SeqLM": "modeling_ofa.EarlyExitOFAForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_ofa.EarlyExitOFAForConditionalGeneration",
    }


def test_in_process_reload_generates_identically(tmp_path):
    model = tiny_model()
    inputs = tiny_inputs()
    model.save_pretrained(tmp_path)
    for loader in (EarlyExitOFAForConditionalGeneration, AutoModel, AutoModelForSeq2SeqLM):
        reloaded = loader.from_pretrained(tmp_path).eval()
        assert isinstance(reloaded, EarlyExitOFAForConditionalGeneration)  # the package's class, no remote code
        assert torch.equal(reloaded.generate(**inputs, **GENERATE), model.generate(**inputs, **GENERATE))
    assert AutoConfig.from_pretrained(tmp_path).model_type == "ofa_early_exit"


SUBPROCESS = """
import sys
sys.modules["hf_earlyexit"] = None  # importing the package now fails: only the shipped remote code can load
import torch
from transformers import AutoModel
inputs = torch.load(sys.argv[2])
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
outputs = {"full": model.generate(**inputs, max_new_tokens=6, num_beams=3, exit_threshold=None)}
for strategy in ("propagate", "copy", "recompute"):
    out = model.generate(**inputs, **GENERATE, kv_strategy=strategy, return_dict_in_generate=True)
    outputs[strategy] = (out.sequences, out.exit_layers, out.encoder_exit_layers)
torch.save(outputs, sys.argv[3])
"""


@pytest.mark.parametrize("exit_heads", [{}, {"exit_adapter_dim": 8}, {"exit_transformer_layers": [1, 3]}])
def test_remote_code_loads_without_the_package_and_exits_early(tmp_path, exit_heads):
    model = tiny_model(decoder_layers=4, **exit_heads)
    model.generation_config.exit_threshold = 0.5  # a saved default: generate exits without being asked
    inputs = tiny_inputs()
    model.save_pretrained(tmp_path / "model")
    assert {"early_exit_cache.py", "exit_controllers.py", "generation_early_exit.py"} <= set(
        os.listdir(tmp_path / "model")
    )
    torch.save(inputs, tmp_path / "inputs.pt")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"GENERATE = {GENERATE!r}\n" + SUBPROCESS,
            str(tmp_path / "model"),
            str(tmp_path / "inputs.pt"),
            str(tmp_path / "out.pt"),
        ],
        check=True,
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    outputs = torch.load(tmp_path / "out.pt")
    assert torch.equal(outputs["full"], model.generate(**inputs, **GENERATE, exit_threshold=None))
    for strategy in ("propagate", "copy", "recompute"):
        out = model.generate(**inputs, **GENERATE, kv_strategy=strategy, return_dict_in_generate=True)
        sequences, exit_layers, encoder_exit_layers = outputs[strategy]
        assert torch.equal(sequences, out.sequences)
        assert torch.equal(exit_layers, out.exit_layers)
        assert torch.equal(encoder_exit_layers, out.encoder_exit_layers)
        assert bool(((exit_layers > 0) & (exit_layers < 4)).any())  # the saved default really exits


CONTROLLERS_SUBPROCESS = """
import sys
import torch
from transformers import AutoModel
inputs = torch.load(sys.argv[2])
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
from hf_earlyexit import PatienceExit  # the user's controllers come from the package, the model from remote code


class Nested(PatienceExit):
    resets, answers = 0, []  # its constructor resets once

    def reset(self):
        super().reset()
        Nested.resets += 1

    def __call__(self, state):
        if not Nested.answers:  # a second call with this instance while the first runs
            try:
                model.generate(**inputs, max_new_tokens=2, exit_controller=self)
                Nested.answers.append("accepted")
            except ValueError as error:
                Nested.answers.append(str(error))
        return super().__call__(state)


controller = Nested(2)
for _ in range(2):
    model.generate(**inputs, max_new_tokens=4, exit_controller=controller)
print(Nested.resets, Nested.answers[0])
"""


def test_the_packages_controllers_keep_their_contract_on_a_remote_code_model(tmp_path):
    """Remote code has its own copy of `ExitController`: a `PatienceExit` from the package is still reset before each
    call, and a second call with it while one runs is still refused."""
    tiny_model(decoder_layers=4).save_pretrained(tmp_path / "model")
    torch.save(tiny_inputs(), tmp_path / "inputs.pt")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run(
        [sys.executable, "-c", CONTROLLERS_SUBPROCESS, str(tmp_path / "model"), str(tmp_path / "inputs.pt")],
        check=True, env=environment, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    resets, answer = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(resets) == 1 + 2 and "running in another `generate` call" in answer, done.stdout


PROCESSOR_SUBPROCESS = """
import sys
sys.modules["hf_earlyexit"] = None
import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
assert type(processor).__module__.startswith("transformers_modules."), type(processor).__module__
inputs = processor(images=Image.new("RGB", (50, 40), (10, 200, 30)), text=" what does the image describe?",
                   return_tensors="pt")
from transformers import pipeline
image, other = Image.new("RGB", (50, 40), (10, 200, 30)), Image.new("RGB", (30, 60), (200, 20, 90))
texts = [" what does the image describe?", " what color is it?"]
pipe = pipeline("image-text-to-text", model=sys.argv[1], trust_remote_code=True)
assert type(pipe.model).__module__.startswith("transformers_modules."), type(pipe.model).__module__
outputs = {
    "generate": model.generate(**inputs, max_new_tokens=5),
    "one": pipe(images=image, text=texts[0], max_new_tokens=5, return_full_text=False),
    "full_text": pipe(images=image, text=texts[0], max_new_tokens=5),
    "batch": pipe(images=[image, other], text=texts, batch_size=2, return_full_text=False,
                  generate_kwargs={"max_new_tokens": 5, "exit_threshold": 0.5, "exit_policy": "confidence"}),
}
try:  # an exit knob given to the pipeline call itself, not in `generate_kwargs`
    pipe(images=image, text=texts[0], exit_threshold=0.5)
except ValueError as error:
    outputs["refused"] = str(error)
torch.save(outputs, sys.argv[2])
"""


def test_model_and_processor_folder_loads_as_remote_code_and_as_local_classes(tmp_path, bart_tokenizer_dir):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor

    from hf_earlyexit import OFAImageProcessor, OFAProcessor

    tokenizer = OFAProcessor.build_tokenizer(str(bart_tokenizer_dir))
    model = tiny_model(vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "model")
    OFAProcessor(OFAImageProcessor(size={"height": 64, "width": 64}), tokenizer).save_pretrained(tmp_path / "model")
    assert {"processing_ofa.py", "processor_config.json", "tokenizer.json"} <= set(os.listdir(tmp_path / "model"))

    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run(
        [sys.executable, "-c", PROCESSOR_SUBPROCESS, str(tmp_path / "model"), str(tmp_path / "out.pt")],
        check=True,
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    processor = AutoProcessor.from_pretrained(tmp_path / "model")  # the package's classes, no remote code
    assert isinstance(processor, OFAProcessor)
    assert isinstance(AutoImageProcessor.from_pretrained(tmp_path / "model"), OFAImageProcessor)
    inputs = processor(
        images=Image.new("RGB", (50, 40), (10, 200, 30)), text=" what does the image describe?", return_tensors="pt"
    )
    outputs = torch.load(tmp_path / "out.pt")
    assert torch.equal(outputs["generate"], model.generate(**inputs, max_new_tokens=5))
    # The image-text-to-text pipeline: the model's own answer, the prompt before it unless asked not to, and exit
    # knobs through `generate_kwargs`.
    answer = processor.batch_decode(outputs["generate"], skip_special_tokens=True)[0]
    assert outputs["one"] == [{"input_text": " what does the image describe?", "generated_text": answer}]
    assert outputs["full_text"][0]["generated_text"] == " what does the image describe?" + answer
    other = Image.new("RGB", (30, 60), (200, 20, 90))
    texts = [" what does the image describe?", " what color is it?"]
    batch = processor(images=[Image.new("RGB", (50, 40), (10, 200, 30)), other], text=texts, return_tensors="pt")
    knobs = {"max_new_tokens": 5, "exit_threshold": 0.5, "exit_policy": "confidence"}
    expected = processor.batch_decode(model.generate(**batch, **knobs), skip_special_tokens=True)
    assert [record["generated_text"] for record in outputs["batch"]] == expected
    assert "generate_kwargs" in outputs["refused"]  # not silently ignored


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"exit_transformer_layers": [9]}, "exit_transformer_layers"),
        ({"exit_adapter_dim": 8, "exit_transformer_layers": [1]}, "not both"),
        ({"exit_adapter_dim": -2}, "exit_adapter_dim"),
        ({"exit_policy": "bogus"}, "exit_policy"),
        ({"exit_treshold": 0.5}, "`from_pretrained` got `exit_treshold`.*did you mean `exit_threshold`"),  # was dropped
        ({"exit_controller": object()}, "`exit_controller` is an object.*pass it to `generate`"),  # was a TypeError
    ],
)
def test_bad_config_overrides_at_load_are_refused_like_a_bad_config(tmp_path, overrides, message):
    """`from_pretrained(dir, field=value)` sets its overrides after the config's checks ran: the model checks again."""
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModel.from_pretrained(tmp_path, **overrides)


@pytest.mark.parametrize("loader", [EarlyExitOFAForConditionalGeneration, AutoModel])
@pytest.mark.parametrize("value", [None, 0.5])
def test_a_knob_given_to_from_pretrained_outranks_the_saved_generation_config(tmp_path, loader, value):
    """Calibration saves its knobs in the generation config; a value given at load time is the user's choice."""
    model = tiny_model()
    model.generation_config.exit_threshold = 0.9
    model.save_pretrained(tmp_path)
    reloaded = loader.from_pretrained(tmp_path, exit_threshold=value)
    assert reloaded.generation_config.exit_threshold == value and reloaded.config.exit_threshold == value
    assert AutoModel.from_pretrained(tmp_path).generation_config.exit_threshold == 0.9  # a later load: the saved
    reloaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert "given_exit_knobs" not in saved and saved["exit_threshold"] == value
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["exit_threshold"] == value


def test_a_config_made_with_a_knob_gives_the_generation_config_its_value_as_it_is_at_load(tmp_path):
    """A config object keeps the names of the knobs it was given, not their values of then: one edited since loads
    with its edit (the value of an earlier call was applied before)."""
    model = tiny_model()
    model.generation_config.exit_threshold = 0.9
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, exit_threshold=0.3)
    config.exit_threshold = 0.6
    reloaded = EarlyExitOFAForConditionalGeneration.from_pretrained(tmp_path, config=config)
    assert reloaded.generation_config.exit_threshold == 0.6 == reloaded.config.exit_threshold


def test_a_knob_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    from hf_earlyexit.modeling.exit_controllers import FixedLayerExit

    model = tiny_model()
    model.generation_config.exit_controller = FixedLayerExit(1)  # fine for `generate`, not for a JSON file
    with pytest.raises(ValueError, match="generation config's `exit_controller` .* cannot be saved as JSON"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_resizing_an_untied_vocabulary_resizes_the_decoders_own_table(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    model.resize_token_embeddings(130)
    tables = (model.encoder.embed_tokens, model.decoder.embed_tokens, model.decoder.output_projection)
    assert [table.weight.shape[0] for table in tables] == [130] * 3 and model.config.vocab_size == 130
    with torch.no_grad():
        model(**tiny_inputs(), decoder_input_ids=torch.tensor([[0, 125], [0, 3]]))  # a new token's id
    model.save_pretrained(tmp_path)
    assert AutoModel.from_pretrained(tmp_path).decoder.embed_tokens.weight.shape[0] == 130
