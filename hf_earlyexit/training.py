"""Training runs around `EarlyExitTrainer`: a small OFA built from scratch on a data set's text, one call that
trains exits on any image-text data set by column names, and the run behind `hf-earlyexit train` and the scripts in
`examples/` (their options: `hf_earlyexit.cli.add_training_arguments`)."""

import argparse
import copy
import json
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .data import (
    CAPTION_PROMPT,
    ImageTextCollator,
    easy_vqa,
    load_image_text_dataset,
    loader_and_folder,
    row_text,
    train_tokenizer,
)
from .loading import check_writable, json_object, load_model_and_processor
from .modeling import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from .modeling.modeling_ofa import in_exit_head
from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from .trainers import RECIPE_FILE, EarlyExitTrainer, EarlyExitTrainingArguments

# A small OFA for 64x64 images (4x4 patches from the light stem); positions and buckets sized for short texts.
SMALL_OFA = dict(
    d_model=128,
    encoder_layers=4,
    decoder_layers=4,
    encoder_ffn_dim=512,
    decoder_ffn_dim=512,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    resnet_type="patch",
    max_position_embeddings=64,
    token_bucket_size=16,
    image_bucket_size=8,
)


def small_model_and_processor(
    texts: list[str], image_size: int = 64, vocab_size: int = 600, seed: int = 0, **config_overrides
) -> tuple[EarlyExitOFAForConditionalGeneration, OFAProcessor]:
    """A randomly initialised small OFA-EE and its processor, with a BPE tokenizer trained on `texts`."""
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    config = OFAEarlyExitConfig(**{**SMALL_OFA, "vocab_size": len(tokenizer), **config_overrides})
    torch.manual_seed(seed)
    model = EarlyExitOFAForConditionalGeneration(config)
    tokenizer.model_max_length = config.max_position_embeddings  # so that `truncation=True` fits the model
    processor = OFAProcessor(OFAImageProcessor(size={"height": image_size, "width": image_size}), tokenizer)
    return model, processor


def train_exits(
    model: Any,
    processor: OFAProcessor,
    train_dataset: datasets.Dataset,
    args: EarlyExitTrainingArguments,
    image_column: str = "image",
    text_column: str | None = "question",
    target_column: str = "answer",
    prompt: str = CAPTION_PROMPT,
    labels: bool = True,
    resume_from_checkpoint: str | None = None,
    **trainer_kwargs,
) -> EarlyExitTrainer:
    """Train `model`'s exits with `args.exit_loss` on `train_dataset` (columns by name) and return the trainer.
    `labels=False` trains without them (the label-free losses: "distill", "adversarial"); `resume_from_checkpoint`
    continues a run from one of its checkpoints."""
    columns = (image_column, target_column, text_column) if text_column else (image_column, target_column)
    if len(train_dataset) == 0:
        raise ValueError("The training data set has no rows.")
    missing = [column for column in columns if column not in train_dataset.column_names]  # "" included: never a column
    if missing:
        raise ValueError(f"The data set has no column(s) {missing}; its columns are {train_dataset.column_names}.")
    for column in (text_column, target_column):
        if column:
            check_texts(train_dataset[column], column, lists=column == target_column)
    check_image_paths(train_dataset, image_column)
    args = copy.copy(args)  # the caller's arguments stay as given
    args.remove_unused_columns = False  # the collator reads the raw image and text columns
    collator = ImageTextCollator(processor, image_column, text_column, target_column, prompt, labels=labels)
    trainer = EarlyExitTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        data_collator=collator,
        processing_class=processor,
        **trainer_kwargs,
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def check_texts(values: Iterable[Any], column: str, lists: bool) -> None:
    """Every value of a text column is a string (`lists`: or a non-empty list of them, whose first is the target):
    checked before training, since the collator meets a bad row only at its batch, after the earlier steps."""
    for row, value in enumerate(values):
        row_text(value, column, row, lists)


def check_image_paths(dataset: datasets.Dataset, column: str) -> None:
    """Every path in an image column of paths names a file: checked before training, since the collator meets a
    missing one only at its batch, after the earlier steps. ValueError naming the first missing path and its row."""
    if dataset.features[column] != datasets.Value("string"):
        return
    for row, path in enumerate(dataset[column]):
        if not os.path.isfile(path):
            raise ValueError(f"Column {column!r}, row {row}: no image at {path}.")


def fine_tune(options: argparse.Namespace, config_fields: dict[str, Any], **training_arguments) -> EarlyExitTrainer:
    """Load the data set and the model (`config_fields` add exit heads), train with `training_arguments` (those of
    `EarlyExitTrainingArguments`), and save the model and processor to `options.output_dir`. The run checkpoints
    there every `options.save_steps` steps, keeping the last, so that a stopped run continues (`options.resume`);
    the saved model replaces the checkpoint."""
    text_column = options.text_column or None
    if options.prompt is not None and text_column:
        raise ValueError(
            f"--prompt gives every row one prompt, but the rows' prompts come from --text-column {text_column!r}: "
            "give --text-column '' with --prompt, or drop --prompt."
        )
    columns = (options.image_column, text_column, options.target_column)
    prompt = CAPTION_PROMPT if options.prompt is None else options.prompt
    output_dir, checkpoint = Path(options.output_dir), None
    if options.resume:
        checkpoint = last_checkpoint(output_dir)
    else:
        check_output_dir(output_dir)
    recipe = run_recipe(options, config_fields, training_arguments, output_dir / RECIPE_FILE if checkpoint else None)
    max_steps = recipe["options"]["max_steps"]
    if options.dataset == "easy-vqa":
        dataset = easy_vqa(options.split or "train")
    else:
        dataset = load_image_text_dataset(options.dataset, options.split, columns, options.image_column)
    if options.model_dir:
        model, processor = load_model_and_processor(options.model_dir, **config_fields)
    elif checkpoint is not None:  # a new model's run: its tokenizer, which one trained on other data would not match
        model, processor = load_model_and_processor(checkpoint, **config_fields)
    else:
        model, processor = small_model_and_processor(tokenizer_texts(dataset, *columns[1:], prompt), **config_fields)
    # Without an accelerator the processes of `accelerate launch` form a data-parallel group only on the CPU backend.
    training_arguments.setdefault("use_cpu", not torch.accelerator.is_available())
    args = EarlyExitTrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=options.learning_rate,
        logging_steps=max(1, max_steps // 20),
        save_strategy="steps",
        save_steps=options.save_steps,
        save_total_limit=1,
        report_to="none",
        **training_arguments,
    )
    if checkpoint is not None:
        check_resumable(Path(checkpoint), model, max_steps)
    write_recipe(output_dir / RECIPE_FILE, recipe)  # once the data and the model loaded: the run starts
    trainer = train_exits(model, processor, dataset, args, *columns, prompt=prompt, resume_from_checkpoint=checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        for folder in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            shutil.rmtree(folder)
    return trainer


# A run's recipe is written when it starts: `--resume` continues that run only, and the model folder carries it.
# Its "options" are how the model was trained (a card `publish` writes shows them); its "data" is what it read (the
# data set and starting model as this machine's paths, which a card does not show).
DATA_OPTIONS = ("dataset", "split", "image_column", "text_column", "target_column", "prompt", "model_dir")
DEFAULT_MAX_STEPS = 1000


def run_recipe(
    options: argparse.Namespace,
    config_fields: dict[str, Any],
    training_arguments: dict[str, Any],
    started: Path | None = None,
) -> dict:
    """What makes a `fine_tune` run what it is: its data and starting model; its heads, loss and optimisation,
    with the processes that share a step (`WORLD_SIZE`) and its `max_steps` in all (`options.max_steps`, else the
    `started` run's, else `DEFAULT_MAX_STEPS`). A run that resumes the one whose recipe is at `started` must be that
    run: ValueError naming everything given otherwise (a run from before recipes were written is not checked)."""
    trained = {name: value for name, value in training_arguments.items() if name not in ("disable_tqdm", "use_cpu")}
    chosen = {
        "batch_size_per_process": options.batch_size,
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
        "learning_rate": options.learning_rate,
        **config_fields,
        **trained,
    }
    data = {name: getattr(options, name, None) for name in DATA_OPTIONS}
    data |= {"dataset": local_source(data["dataset"]), "model_dir": local_source(data["model_dir"])}
    given = json.loads(json.dumps({"options": chosen, "data": data}, default=str))
    given["options"] = {name: value for name, value in given["options"].items() if value is not None}
    before = json_object(started) if started is not None and started.is_file() else {}
    differ = [
        (name, before[part].get(name), given[part].get(name))
        for part in ("data", "options")
        if part in before
        for name in sorted({*before[part], *given[part]} - {"max_steps"})
        if before[part].get(name) != given[part].get(name)
    ]
    if differ:
        raise ValueError(
            f"--resume continues the stopped run as it started ({started.name}): "
            + "; ".join(f"{name}={then!r} there, {now!r} here" for name, then, now in differ)
            + ". Give the same options, or train into a new --output-dir."
        )
    max_steps = options.max_steps or before.get("options", {}).get("max_steps") or DEFAULT_MAX_STEPS
    return {"script": Path(sys.argv[0]).name, **given, "options": {**given["options"], "max_steps": max_steps}}


def local_source(source: str | None) -> str | None:
    """A data set or model given as a path, `loader:path` included, with the path made absolute (the same folder
    written another way is the same); a name (`easy-vqa`, a Hub id) as it is."""
    if source is None:
        return None
    loader, path = loader_and_folder(source) or ("", source)
    if not Path(path).exists():
        return source
    return f"{loader}:{Path(path).resolve()}" if loader else str(Path(path).resolve())


def write_recipe(path: Path, recipe: dict) -> None:
    """`recipe` into `path`, whole (each process of a sharded run writes the same)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(recipe, indent=2) + "\n")
    partial.replace(path)


def tokenizer_texts(dataset: Any, text_column: str | None, target_column: str, prompt: str) -> list[str]:
    """What a new model's tokenizer learns from: the prompts (the one `prompt` without a text column) and every
    target, each of a list of references too."""
    texts = [] if text_column else [prompt]
    for column in (text_column, target_column):
        for value in dataset[column] if column else []:
            texts += value if isinstance(value, (list, tuple)) else [value]
    return [text for text in texts if isinstance(text, str)]


def check_output_dir(output_dir: Path) -> None:
    """A run saves a whole model into its output folder: one that holds files already (a model, an earlier run's
    output) would be overwritten in part, leaving its other files to describe weights that are gone. The recipe
    alone is what a run that failed before its first checkpoint left: the new run replaces it."""
    if output_dir.exists() and (
        not output_dir.is_dir() or any(path.name != RECIPE_FILE for path in output_dir.iterdir())
    ):
        raise ValueError(
            f"{output_dir} is not an empty folder: train into a new one, or --resume a stopped run's last checkpoint "
            "there (nothing was overwritten)."
        )
    check_writable(output_dir, "--output-dir")  # before the training, whose checkpoints and model go there


def check_resumable(checkpoint: Path, model: Any, max_steps: int) -> None:
    """A stopped run continues with the model it trained and more steps than it took. ValueError otherwise: the
    Trainer would fail to load another model's weights (or optimizer), or train past --max-steps. A run stopped
    after its last step is finished: its checkpoint holds the model (weights, config, processor)."""
    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    if step >= max_steps:
        raise ValueError(
            f"{checkpoint} stopped at step {step}, which --max-steps {max_steps} leaves nothing after: that folder "
            "holds the trained model (load or evaluate it as it is), or give more --max-steps to train on."
        )
    saved = saved_shapes(checkpoint)
    own = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    differ = [name for name, shape in saved.items() if own.get(name) != shape]
    differ += [name for name in own if name not in saved and in_exit_head(name)]  # heads the stopped run had not
    if differ:
        name = differ[0]
        raise ValueError(
            f"{checkpoint} holds another model's weights than the one these options make ({name}: "
            f"{saved.get(name, 'absent')} there, {own.get(name, 'absent')} here): resume with the stopped run's "
            "--model-dir and head options."
        )


def saved_shapes(folder: Path) -> dict[str, list[int]]:
    """The shape of every tensor in `folder`'s safetensors files, read from their headers."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as weights:
            shapes.update({name: list(weights.get_slice(name).get_shape()) for name in weights.keys()})
    return shapes


def last_checkpoint(output_dir: Path) -> str:
    """The last complete checkpoint a stopped run left in `output_dir` (its `trainer_state.json`, written last, is
    there: a run stopped while saving leaves a newer one without it); ValueError when there is none."""
    folders = output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if output_dir.is_dir() else []
    steps = {
        folder: int(folder.name.rsplit("-", 1)[1])
        for folder in folders
        if folder.name.rsplit("-", 1)[1].isdigit() and (folder / "trainer_state.json").is_file()
    }
    if not steps:
        raise ValueError(f"{output_dir} holds no complete checkpoint of a stopped run to resume from.")
    return str(max(steps, key=steps.get))


__all__ = ["SMALL_OFA", "fine_tune", "small_model_and_processor", "train_exits"]
