"""Publishing a trained model to the Hugging Face Hub as a repository that loads anywhere.

`publish` assembles a Hub-ready folder (weights, config with `auto_map`, the remote-code files, tokenizer and
processor files, the generation config with the calibrated exit defaults, a model card with the measured
trade-off), checks it in a separate Python process where `hf_earlyexit` cannot be imported, and only then creates
the repository and uploads the folder. The card comes from `hf_earlyexit.model_cards`, through which
`EarlyExitTrainer(push_to_hub=True)` writes the same card.
"""

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .calibration import PLOT_FILE
from .loading import check_model_dir, json_object, load_model_and_processor, weights_fingerprint
from .model_cards import measured_table, read_benchmark, render_model_card
from .modeling import EarlyExitOFAForConditionalGeneration
from .modeling.exit_controllers import FixedLayerExit
from .modeling.exit_knobs import NO_EXIT, resolve_knobs
from .modeling.processing_ofa import OFAProcessor
from .trainers import RECIPE_FILE

# Copied from the model folder when present: the calibration sweep and how the model was trained.
RECORDS = ("calibration.json", "calibration_speculative.json", RECIPE_FILE)
VALIDATION_IMAGE = "validation_image.png"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class PublishError(RuntimeError):
    """Creating the repository or uploading failed; the assembled folder is kept at `folder`."""

    def __init__(self, message: str, folder: Path):
        super().__init__(message)
        self.folder = folder


@dataclass
class Published:
    folder: Path  # the assembled, validated folder
    url: str | None  # the repository's URL; None for a dry run
    validation: dict[str, Any]  # what the isolated load and generation reported


# ---------------------------------------------------------------------------------------------------------------
# The folder and its validation
# ---------------------------------------------------------------------------------------------------------------


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"Invalid repo id {repo_id!r}: {error}") from None


def assemble(
    model_dir: str | Path,
    output_dir: str | Path,
    repo_id: str,
    benchmark: list[str | Path] | None = None,
    plot: str | Path | None = None,
    **card_fields,
) -> Path:
    """Write the Hub-ready folder of `model_dir` to `output_dir`: re-saved with this package's model code (weights
    as safetensors, configs with `auto_map`, processor and tokenizer files, generation defaults), the records in
    `RECORDS`, the plot and the card. `benchmark`: files of `bench --json` lines (default the folder's
    benchmark.jsonl); `plot`: a PNG (default the folder's tradeoff.png). `card_fields` go to `render_model_card`.
    Refuses a card without measured numbers and an `output_dir` that holds something other than a model folder."""
    move_into(*staged_assembly(model_dir, output_dir, repo_id, benchmark, plot, **card_fields))
    return Path(output_dir)


def staged_assembly(
    model_dir: str | Path,
    output_dir: str | Path,
    repo_id: str,
    benchmark: list[str | Path] | None = None,
    plot: str | Path | None = None,
    **card_fields,
) -> tuple[Path, Path, bool]:
    """`assemble`'s folder, whole, in a staging folder beside `output_dir`: (staging, the folder it is to replace,
    whether that holds an earlier assembly). `move_into` puts it in place; a failure here leaves no staging folder."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    check_repo_id(repo_id)
    config = check_model_dir(model_dir)
    if benchmark is None:
        benchmark = [model_dir / "benchmark.jsonl"] if (model_dir / "benchmark.jsonl").is_file() else []
    records = [record for path in benchmark for record in read_benchmark(path)]
    if not records:
        raise ValueError(
            f"The model card needs measured numbers: run `hf-earlyexit bench {model_dir} --task TASK --json >> "
            f"{model_dir / 'benchmark.jsonl'}` (or pass --benchmark FILE)."
        )
    plot = checked_plot(model_dir, plot)
    # This package's classes, whose code the folder ships; weights checked against the config as every command does.
    model, processor = load_model_and_processor(model_dir, remote_code=False)
    check_measured_on(model_dir, benchmark)  # once the weights are known to read
    resolve_knobs(model.config, model.generation_config)  # saved exit defaults checked before the assembly
    replacing = check_replaceable(output_dir, model_dir)
    # Assembled beside `output_dir` and moved into place once whole: an earlier assembly stays until then, and a
    # stopped run leaves only this staging folder, which the next run clears. Named from the folder `output_dir`
    # stands for ("." or a link), whose files are replaced in it.
    target = output_dir.resolve()
    staging = target.with_name(f".{target.name}.assembling")
    if staging == model_dir.resolve():
        raise ValueError(f"The model folder {model_dir} has the name of {output_dir}'s staging folder: move it.")
    if staging.exists():
        shutil.rmtree(staging)
    with removed_on_failure(staging):
        processor.save_pretrained(staging)
        model.save_pretrained(staging)  # safetensors, config (auto_map) and the remote-code files
        for name in RECORDS:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, staging / name)
        if (staging / RECIPE_FILE).is_file():  # its data block names this machine's folders (for `--resume`)
            recipe = {key: value for key, value in json_object(staging / RECIPE_FILE).items() if key != "data"}
            (staging / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        (staging / "benchmark.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        if plot is not None:
            shutil.copy(plot, staging / PLOT_FILE)
        write_card(staging, model, config, records, repo_id, plot is not None, card_fields)
        written = sorted(staging.iterdir())
        (staging / ASSEMBLY_MANIFEST).write_text("".join(f"{path.name}\t{digest(path)}\n" for path in written))
        # Transformers writes the weights readable by their owner alone (0600): every file as readable as the
        # manifest, which this process wrote under the user's umask.
        mode = (staging / ASSEMBLY_MANIFEST).stat().st_mode & 0o777
        for path in staging.iterdir():
            if path.is_file():
                path.chmod(mode)
    return staging, target, replacing


def check_measured_on(model_dir: Path, benchmark: list[str | Path]) -> None:
    """The records in the `benchmark` files (read: `read_benchmark`) and the folder's calibration records were
    measured on `model_dir`'s weights, where they name theirs (`weights_fingerprint`; records from before it are
    taken as they are). ValueError naming the first that was not: the card would show another model's numbers, or
    guarantees."""
    weights = weights_fingerprint(model_dir)
    for path in benchmark:
        for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
            recorded = json.loads(line).get("weights") if line.strip() else None
            if recorded not in (None, weights):
                raise ValueError(
                    f"{path}, line {number}: measured on other weights (fingerprint {recorded}) than {model_dir}'s "
                    f"({weights}): re-run `hf-earlyexit bench {model_dir} --json` on them."
                )
    for name in RECORDS:
        path = model_dir / name
        recorded = json_object(path).get("weights") if path.is_file() else None
        if recorded not in (None, weights):
            raise ValueError(
                f"{path} was written for other weights (fingerprint {recorded}) than {model_dir}'s ({weights}): "
                f"calibrate this model again (`hf-earlyexit calibrate {model_dir} --write`), or remove it."
            )


@contextlib.contextmanager
def removed_on_failure(staging: Path):
    """`staging` removed if the work inside fails or is interrupted: an earlier assembly stays as it was."""
    try:
        yield
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def checked_plot(model_dir: Path, plot: str | Path | None) -> Path | None:
    """The card's plot: `plot`, which must be a PNG, else the model folder's tradeoff.png if it has one."""
    if plot is None:
        return model_dir / PLOT_FILE if (model_dir / PLOT_FILE).is_file() else None
    if not Path(plot).is_file():
        raise ValueError(f"No plot at {plot}.")
    if not Path(plot).read_bytes().startswith(PNG_SIGNATURE):
        raise ValueError(f"{plot} is not a PNG image: the card shows it as tradeoff.png.")
    return Path(plot)


def move_into(staging: Path, target: Path, replacing: bool) -> None:
    """The files of a whole assembly in `staging` moved into the folder `target`, in place of an earlier assembly's
    (`replacing`), and `staging` removed."""
    target.mkdir(parents=True, exist_ok=True)
    for path in target.iterdir() if replacing else []:  # the earlier assembly's files, as its manifest lists them
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in staging.iterdir():
        path.rename(target / path.name)
    staging.rmdir()


def write_card(
    folder: Path, model, config: dict, records: list[dict], repo_id: str, plot: bool, card_fields: dict[str, Any]
) -> None:
    """The model card, README.md, of an assembled `folder` from its records and the model's saved defaults."""
    recipe_file, calibration_file = folder / RECIPE_FILE, folder / "calibration.json"
    try:
        table = measured_table(records, model.generation_config.to_dict())
    except (TypeError, KeyError, AttributeError) as error:  # the keys are there, their values are not bench's
        raise ValueError(f"A benchmark record is not what `hf-earlyexit bench --json` prints ({error!r}).") from None
    card = render_model_card(
        repo_id,
        config,
        model.generation_config.to_dict(),
        table,
        recipe=json_object(recipe_file) if recipe_file.is_file() else None,
        plot=PLOT_FILE if plot else None,
        calibration=json_object(calibration_file) if calibration_file.is_file() else None,
        **card_fields,
    )
    (folder / "README.md").write_text(card)


# What `assemble` wrote, so that a later run replaces exactly that and nothing a user put beside it.
ASSEMBLY_MANIFEST = ".hf-earlyexit-assembly"


def check_replaceable(output_dir: Path, model_dir: Path) -> bool:
    """Whether `output_dir` holds a previous assembly to replace (False: it is absent or empty). ValueError when it
    holds, lies in or is the model folder, or holds anything `assemble` did not write there."""
    output, source = output_dir.resolve(), model_dir.resolve()
    if output == source or output in source.parents or source in output.parents:
        raise ValueError(f"The output folder {output_dir} must not be, hold or lie in the model folder {model_dir}.")
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"The output folder {output_dir} is a file: give a folder to assemble into.")
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return False
    manifest = output_dir / ASSEMBLY_MANIFEST
    lines = manifest.read_text().splitlines() if manifest.is_file() else []
    written = dict(f"{line}\t".split("\t")[:2] for line in lines)  # name, tab, SHA-256 (a name alone: older manifests)
    others = sorted(path.name for path in output_dir.iterdir() if path.name not in {*written, ASSEMBLY_MANIFEST})
    if not written or others:
        holds = f"it also holds {others[:3]}" if written else "no record of an assembly"
        raise ValueError(
            f"{output_dir} exists and is not a model folder that `publish` assembled alone ({holds}): give another "
            "--output-dir."
        )
    changed = [name for name, recorded in written.items() if recorded and digest(output_dir / name) != recorded]
    if changed:  # an edited card, say: replacing it would lose the edit
        raise ValueError(
            f"{output_dir / changed[0]} changed since `publish` assembled it: move it away (or the whole folder), "
            "or give another --output-dir."
        )
    return True


def digest(path: Path) -> str:
    """A file's SHA-256 (hex), or "" for a folder."""
    if not path.is_file():
        return ""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


# Runs in a fresh interpreter: `hf_earlyexit` cannot be imported, the Hub is offline, the modules cache is new.
VALIDATION_SCRIPT = """
import importlib, json, sys
sys.modules["hf_earlyexit"] = None  # any import of the package now fails
import torch
from PIL import Image
from transformers import AutoModel, AutoProcessor

folder, image_path, no_exit, first = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
controllers = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".exit_controllers")
inputs = processor(images=Image.open(image_path), text=" what does the image describe?", return_tensors="pt")
forced = {**no_exit, "exit_controller": controllers.FixedLayerExit(first)}
runs = {"full": no_exit, "defaults": {}, "first_exit": forced}
report = {"module": type(model).__module__}
with torch.no_grad():
    for name, knobs in runs.items():
        out = model.generate(**inputs, **knobs, max_new_tokens=8, do_sample=False, num_beams=1,
                             return_dict_in_generate=True)
        report[name] = {"sequences": out.sequences.tolist(), "exit_layers": out.exit_layers.tolist(),
                        "encoder_exit_layers": out.encoder_exit_layers.tolist()}
report["hf_earlyexit_imported"] = sys.modules.get("hf_earlyexit") is not None
print(json.dumps(report))
"""


def validate_folder(folder: str | Path, timeout: float = 600) -> dict[str, Any]:
    """Load `folder` with `trust_remote_code=True` in a subprocess where `hf_earlyexit` is not importable (offline,
    empty modules cache) and generate with no exit, with the saved exit defaults and with every token exiting at the
    first exit point (decoder layer 1, or BLIPEE's first exit layer); check that each gives this package's tokens,
    that the full model ran every layer and the forced tokens exited there. Returns the subprocess's report; raises
    ValueError with the reason otherwise."""
    folder = Path(folder)
    model = EarlyExitOFAForConditionalGeneration.from_pretrained(folder).eval()
    first = model.config.exit_points[0]
    with tempfile.TemporaryDirectory() as scratch:
        image_path = Path(scratch) / VALIDATION_IMAGE
        pixels = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(image_path)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(Path(scratch) / "modules")}
        env.pop("PYTHONPATH", None)
        try:
            result = subprocess.run(
                [sys.executable, "-c", VALIDATION_SCRIPT, str(folder.resolve()), str(image_path), json.dumps(NO_EXIT),
                 str(first)],
                capture_output=True, text=True, env=env, cwd=scratch, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ValueError(f"Validation of {folder} did not finish in {timeout:.0f} s.") from None
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
            raise ValueError(f"{folder} does not load and generate without hf_earlyexit: {last}")
        report = json.loads(result.stdout.strip().splitlines()[-1])
        inputs = OFAProcessor.from_pretrained(folder)(
            images=Image.open(image_path), text=" what does the image describe?", return_tensors="pt"
        )
        with torch.no_grad():
            runs = {"full": NO_EXIT, "defaults": {}, "first_exit": NO_EXIT | {"exit_controller": FixedLayerExit(first)}}
            expected = {
                name: model.generate(**inputs, **knobs, max_new_tokens=8, do_sample=False, num_beams=1)
                for name, knobs in runs.items()
            }
    depth = model.config.decoder_layers
    problems = []
    if report["hf_earlyexit_imported"] or report["module"].startswith("hf_earlyexit"):
        problems.append("the model loaded hf_earlyexit instead of the folder's code")
    for name, sequences in expected.items():
        if report[name]["sequences"] != sequences.tolist():
            problems.append(f"the remote code's {name.replace('_', ' ')} tokens differ from this package's")
    if any(layer not in (0, depth) for row in report["full"]["exit_layers"] for layer in row):
        problems.append("the full model exited early")
    if any(layer not in (0, first) for row in report["first_exit"]["exit_layers"] for layer in row):
        problems.append(f"tokens forced to exit after layer {first} did not")
    if problems:
        raise ValueError(f"{folder} failed validation: {'; '.join(problems)}.")
    return report


def check_card(folder: Path) -> None:
    """The card parses with `huggingface_hub.ModelCard` and holds the measured table."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    if card.data.library_name != "transformers" or "| wall-clock reduction |" not in card.text:
        raise ValueError(f"{folder / 'README.md'} lacks the metadata or the measured table.")


# ---------------------------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------------------------


def say(progress: bool, stage: str) -> None:
    if progress:
        print(f"{stage} ...", file=sys.stderr, flush=True)


def publish(
    model_dir: str | Path,
    repo_id: str,
    private: bool = False,
    dry_run: bool = False,
    output_dir: str | Path | None = None,
    token: str | None = None,
    commit_message: str = "Upload OFA-EE model with hf-earlyexit",
    progress: bool = False,
    **assemble_kwargs,
) -> Published:
    """Assemble `model_dir` for `repo_id` (in `output_dir`, default a folder named after the repo), validate it,
    and unless `dry_run` create the repository and upload the folder. The token is `token`, else the one
    `huggingface_hub` finds (`HF_TOKEN`, `hf auth login`). Bad input raises ValueError before anything is written
    or sent; a failed upload raises PublishError, keeping the folder. `progress`: each stage is announced on stderr,
    and the upload shows `huggingface_hub`'s progress bars."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.utils import enable_progress_bars

    check_repo_id(repo_id)
    check_model_dir(Path(model_dir))
    token = token or get_token()
    if not dry_run and not token:
        raise ValueError("No Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass --token.")
    folder = Path(output_dir or repo_id.split("/")[-1])
    say(progress, f"assembling {folder}")
    staging, target, replacing = staged_assembly(model_dir, folder, repo_id, **assemble_kwargs)
    with removed_on_failure(staging):  # validated before it replaces an earlier assembly
        check_card(staging)
        say(progress, "validating: a fresh process, without hf_earlyexit, loads it with remote code and generates")
        report = validate_folder(staging)
    move_into(staging, target, replacing)
    if dry_run:
        return Published(folder, None, report)
    say(progress, f"uploading to {repo_id}")
    if progress:
        enable_progress_bars()
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            repo_type="model",
            ignore_patterns=[ASSEMBLY_MANIFEST],
        )
    except Exception as error:  # whatever the network or the Hub raised, the user must learn where the folder is
        raise PublishError(
            f"Uploading to {repo_id} failed ({type(error).__name__}: {error}); the folder is kept at {folder}.",
            folder,
        ) from error
    return Published(folder, str(url), report)


__all__ = ["PublishError", "Published", "assemble", "check_card", "publish", "validate_folder"]
