"""Loading what the commands work on: images, a saved model with its processor, the processor of a converted
checkpoint. Every user error is a ValueError that names the path or the mismatch."""

import contextlib
import functools
import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from safetensors import SafetensorError, safe_open

from .modeling.modeling_ofa import EarlyExitOFAForConditionalGeneration, in_exit_head
from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor

# The small calibrated model that ships inside the package (what `hf-earlyexit demo` runs).
EMBEDDED_MODEL_DIR = Path(__file__).parent / "embedded_model"
# The config fields that shape exit heads' weights; the others (e.g. MuE's `decompose_encoder_modalities`) load any.
HEAD_SHAPES = ("exit_adapter_dim", "exit_transformer_layers")
MODEL_TYPE = EarlyExitOFAForConditionalGeneration.config_class.model_type


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file at `path`; ValueError when it is not JSON or holds something else."""
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object.")
    return value


def check_writable(target: Path, option: str) -> None:
    """ValueError, naming the `option` that gave `target`, unless this process can write `target` (a file, or a
    folder's files): it exists and is writable, or the first folder above it that exists is. Checked before long
    work, whose result a bad path would lose."""
    folder = target.absolute()
    while not folder.exists():  # what writes there makes the missing folders in the first one that exists
        folder = folder.parent
    if folder != target.absolute() and not folder.is_dir():
        raise ValueError(f"{option} {target}: {folder} is not a folder.")
    if not os.access(folder, os.W_OK | (os.X_OK if folder.is_dir() else 0)):
        raise ValueError(f"{option} {target}: this process cannot write into {folder}.")


def check_model_dir(model_dir: Path) -> dict[str, Any]:
    """The folder's config, or ValueError when it is not an hf-earlyexit model; a generation config that does not
    read is an error too (Transformers would drop it, and with it the calibrated exits, for the model config's)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{model_dir} is not a model folder (no config.json).")
    config = json_object(config_file)
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"{model_dir} is not an hf-earlyexit model (model_type {config.get('model_type')!r}, not an hf-earlyexit "
            f"OFA model's {MODEL_TYPE!r})."
        )
    if (model_dir / "generation_config.json").is_file():
        json_object(model_dir / "generation_config.json")
    return config


def weights_fingerprint(model_dir: str | Path) -> str | None:
    """The first 16 hex digits of a SHA-256 over the weights in a model folder (`model*.safetensors`, else
    `pytorch_model*.bin`): each tensor's name, dtype, shape and bytes, by name, so the same weights give the same
    fingerprint however they were saved (in shards or not). What a benchmark or calibration record was measured on,
    which `publish` checks, so that a card never shows another model's numbers. None for a folder without weights."""
    folder = Path(model_dir)
    with contextlib.ExitStack() as files:
        tensors: dict[str, Callable[[], torch.Tensor]] = {}
        for path in sorted(folder.glob("model*.safetensors")):
            weights = files.enter_context(safe_open(path, "pt"))
            tensors |= {name: functools.partial(weights.get_tensor, name) for name in weights.keys()}
        for path in [] if tensors else sorted(folder.glob("pytorch_model*.bin")):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            tensors |= {name: functools.partial(state.__getitem__, name) for name in state}
        if not tensors:
            return None
        digest = hashlib.sha256()
        for name in sorted(tensors):
            tensor = tensors[name]()
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def load_image(path: str | Path) -> Image.Image:
    """The image at `path` as RGB, upright; ValueError when it is absent or not an image."""
    return open_image(path).convert("RGB")


def open_image(source: str | Path | io.BytesIO) -> Image.Image:
    """The image in a file or bytes, in its own mode, turned upright by its EXIF orientation, as `datasets.Image`
    decodes it (a phone photo then reads alike whichever way it comes); ValueError when it is absent or not an
    image."""
    try:
        with Image.open(source) as image:
            return ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise ValueError(f"No image at {source}.") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"Cannot read {source} as an image ({error}).") from None


def load_model_and_processor(model_dir: str | Path, remote_code: bool = True, **config_fields: Any) -> tuple[Any, Any]:
    """A saved hf-earlyexit model (in eval mode) and its processor, through `AutoModel` / `AutoProcessor` with the
    folder's own code (`remote_code`), else this package's classes; `config_fields` override the config (e.g. to
    add exit heads). ValueError when `model_dir` is not an hf-earlyexit model folder, or its weights, generation
    config or processor do not read."""
    from transformers import AutoModel, AutoProcessor
    from transformers.utils import logging

    model_class, processor_class = (AutoModel, AutoProcessor) if remote_code else (
        EarlyExitOFAForConditionalGeneration, OFAProcessor
    )  # fmt: skip
    path = Path(model_dir)
    saved = check_model_dir(path)
    for name, value in config_fields.items():  # heads of another shape than the saved ones cannot load their weights
        if name in HEAD_SHAPES and saved.get(name) is not None and saved[name] != value:
            raise ValueError(f"{path} has {name}={saved[name]!r}; it cannot load as {name}={value!r}.")
    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # Transformers' table of missing weights: the check below says what matters
    logging.disable_progress_bar()  # the weight-loading bar would break the CLI's one-line errors
    try:
        model, loaded = loaded_model(model_class, path, config_fields)
        processor = loaded_processor(processor_class, path)
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
    missing = sorted(name for name in loaded["missing_keys"] if not in_exit_head(name))  # new heads start as identity
    unexpected = sorted(loaded["unexpected_keys"])
    if missing or unexpected:
        raise ValueError(
            f"{path}: the weights do not fit config.json ({len(missing)} missing, e.g. {missing[:2]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:2]}): a config edited apart from its weights?"
        )
    return model.eval(), processor


def loaded_model(model_class: Any, path: Path, config_fields: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`model_class.from_pretrained` of `path` with its loading info; ValueError on weights that do not read."""
    try:
        return model_class.from_pretrained(path, trust_remote_code=True, output_loading_info=True, **config_fields)
    except SafetensorError as error:
        raise ValueError(f"{path}: its weights are not a readable safetensors file ({error}).") from None


def loaded_processor(processor_class: Any, path: Path) -> Any:
    """`processor_class.from_pretrained` of `path`; ValueError naming a processor that is not there."""
    try:
        return processor_class.from_pretrained(path, trust_remote_code=True)
    except OSError as error:  # Transformers' "Can't load ..." (no processor saved), with a Hub address to try
        raise ValueError(
            f"{path}: no processor loads from it ({str(error).splitlines()[0]}): save the model's processor "
            "beside it (`processor.save_pretrained`)."
        ) from None


def build_processor(tokenizer_dir: str | Path, image_size: int, config: Any) -> OFAProcessor:
    """The processor of a converted checkpoint: BART's tokenizer from `tokenizer_dir` with OFA's tokens, truncating
    (when asked) to the model's positions, and square `image_size` images. ValueError when the tokenizer does not fit
    the model's vocabulary."""
    tokenizer = OFAProcessor.build_tokenizer(str(tokenizer_dir))
    if len(tokenizer) != config.vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {config.vocab_size}."
        )
    tokenizer.model_max_length = config.max_position_embeddings
    return OFAProcessor(OFAImageProcessor(size={"height": image_size, "width": image_size}), tokenizer)


__all__ = [
    "EMBEDDED_MODEL_DIR",
    "build_processor",
    "check_model_dir",
    "load_image",
    "load_model_and_processor",
    "open_image",
    "weights_fingerprint",
]
