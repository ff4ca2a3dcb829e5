"""Loading what the commands work on: images, a saved model with its processor, the processor of a converted
checkpoint. Every user error is a ValueError that names the path or the mismatch."""

from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError
from safetensors import SafetensorError

from .modeling.modeling_ofa import in_exit_head
from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from .publishing import check_model_dir

# The small calibrated model that ships inside the package (what `hf-earlyexit demo` runs).
EMBEDDED_MODEL_DIR = Path(__file__).parent / "embedded_model"
# The config fields that shape exit heads' weights; the others (e.g. MuE's `decompose_encoder_modalities`) load any.
HEAD_SHAPES = ("exit_adapter_dim", "exit_transformer_layers")


def load_image(path: str | Path) -> Image.Image:
    """The image at `path` as RGB; ValueError when it is absent or not an image."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"No image at {path}.") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"Cannot read {path} as an image ({error}).") from None


def load_model_and_processor(model_dir: str | Path, **config_fields: Any) -> tuple[Any, Any]:
    """A saved hf-earlyexit model (in eval mode) and its processor; `config_fields` override the config (e.g. to
    add exit heads). ValueError when `model_dir` is not an hf-earlyexit model folder."""
    from transformers import AutoModel, AutoProcessor
    from transformers.utils import logging

    logging.disable_progress_bar()  # the weight-loading bar would break the CLI's one-line errors
    path = Path(model_dir)
    saved = check_model_dir(path)
    for name, value in config_fields.items():  # heads of another shape than the saved ones cannot load their weights
        if name in HEAD_SHAPES and saved.get(name) is not None and saved[name] != value:
            raise ValueError(f"{path} has {name}={saved[name]!r}; it cannot load as {name}={value!r}.")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # Transformers' table of missing weights: the check below says what matters
    try:
        model, loaded = AutoModel.from_pretrained(
            path, trust_remote_code=True, output_loading_info=True, **config_fields
        )
    except SafetensorError as error:
        raise ValueError(f"{path}: its weights are not a readable safetensors file ({error}).") from None
    finally:
        logging.set_verbosity(verbosity)
    missing = sorted(name for name in loaded["missing_keys"] if not in_exit_head(name))  # new heads start as identity
    unexpected = sorted(loaded["unexpected_keys"])
    if missing or unexpected:
        raise ValueError(
            f"{path}: the weights do not fit config.json ({len(missing)} missing, e.g. {missing[:2]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:2]}): a config edited apart from its weights?"
        )
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    return model.eval(), processor


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


__all__ = ["EMBEDDED_MODEL_DIR", "build_processor", "load_image", "load_model_and_processor"]
