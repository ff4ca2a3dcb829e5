# Copyright 2025 The hf-earlyexit authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
Image and text processing for OFA (One For All) vision-language models.

This file is shipped next to the model weights as Hugging Face remote code, so it only depends on torch, numpy, PIL
and transformers. It provides:

- [`OFAImageProcessor`]: converts any image to RGB, resizes it to a fixed square with bicubic filtering (no crop, no
  aspect-ratio preservation), rescales to `[0, 1]` and normalizes with mean = std = 0.5, i.e. to `[-1, 1]`. This is
  exactly the torchvision pipeline of the original OFA code, applied to `Image.open(...).convert("RGB")`:
  `Resize((R, R), BICUBIC) -> ToTensor() -> Normalize([0.5] * 3, [0.5] * 3)`.
- [`OFAProcessor`]: bundles the image processor with OFA's BART byte-level BPE tokenizer.
- [`add_ofa_special_tokens`]: appends OFA's `<code_*>` (image codes) and `<bin_*>` (location bins) tokens to a BART
  tokenizer so that token ids match the official checkpoints.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import BartTokenizer, BatchFeature, GenerationConfig
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import ChannelDimension, PILImageResampling, SizeDict
from transformers.processing_utils import ProcessorMixin, TextKwargs
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.utils import logging

from .exit_knobs import EXIT_KNOBS

logger = logging.get_logger(__name__)
# What `generate` takes: given to the processor (a pipeline hands it the call's unknown keyword arguments), refused.
GENERATE_OPTIONS = frozenset(EXIT_KNOBS) | frozenset(vars(GenerationConfig()))

# A single image accepted by `OFAImageProcessor`, and what may be passed as `images` (one image or a list of them).
SingleImage = Image.Image | np.ndarray | torch.Tensor
OFAImageInput = SingleImage | Sequence[SingleImage]

# OFA's vocabulary = BART's 50265 tokens, then 8192 image-code tokens, then 1000 location-bin tokens.
OFA_NUM_CODES = 8192
OFA_NUM_BINS = 1000

# Channel counts we know how to turn into RGB: grayscale, RGB and RGB + alpha.
_VALID_NUM_CHANNELS = (1, 3, 4)


def _describe(obj: Any) -> str:
    """Short human-readable description of an object for error messages."""
    if isinstance(obj, str):
        return f"str {obj[:60]!r} (image paths and URLs are not supported: open the image with PIL first)"
    return type(obj).__name__


def _array_to_uint8(array: np.ndarray) -> np.ndarray:
    """
    Bring an array's values to uint8 `[0, 255]`.

    Floating point arrays must hold values in `[0, 1]` (as produced by `ToTensor`-like pipelines); they are scaled by
    255 and *rounded*, so that `uint8_image / 255` gives back exactly `uint8_image`. Integer and boolean arrays must
    already lie in `[0, 255]`.
    """
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.floating):
        if not np.all(np.isfinite(array)):
            raise ValueError("Float image contains NaN or infinite values.")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(f"Float image values must lie in [0, 1], got values in [{low}, {high}].")
        return np.round(array.astype(np.float64) * 255.0).astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > 255:
            raise ValueError(f"Integer image values must lie in [0, 255], got values in [{low}, {high}].")
        return array.astype(np.uint8)
    raise ValueError(f"Unsupported image array dtype {array.dtype}.")


def _channel_axis(
    shape: tuple[int, ...], channels_first_default: bool, input_data_format: ChannelDimension | None
) -> int:
    """
    Find the channel axis (0 or 2) of a 3-D image array.

    Numpy images are conventionally `(H, W, C)` and torch images `(C, H, W)`: when both ends of the shape could be the
    channel axis (e.g. a 3x3x3 image), `channels_first_default` breaks the tie. `input_data_format` overrides it all.
    """
    if input_data_format is not None:
        axis = 0 if ChannelDimension(input_data_format) == ChannelDimension.FIRST else 2
        if shape[axis] not in _VALID_NUM_CHANNELS:
            raise ValueError(
                f"Image of shape {shape} has {shape[axis]} channels on the axis given by "
                f"input_data_format={input_data_format!s}; expected 1, 3 or 4 channels."
            )
        return axis
    first_ok, last_ok = shape[0] in _VALID_NUM_CHANNELS, shape[-1] in _VALID_NUM_CHANNELS
    if first_ok and last_ok:
        return 0 if channels_first_default else 2
    if last_ok:
        return 2
    if first_ok:
        return 0
    raise ValueError(
        f"Could not find a channel dimension of size 1, 3 or 4 in image of shape {shape}: expected (H, W, C) or "
        "(C, H, W) with 1 (grayscale), 3 (RGB) or 4 (RGBA) channels."
    )


def to_rgb_pil_image(image: SingleImage, input_data_format: str | ChannelDimension | None = None) -> Image.Image:
    """
    Convert one image to an RGB `PIL.Image.Image`, validating it on the way.

    Args:
        image (`PIL.Image.Image`, `np.ndarray` or `torch.Tensor`):
            A PIL image of any mode (`"L"`, `"RGBA"`, `"P"`, `"I;16"`, ...), or an array/tensor of shape `(H, W)`,
            `(H, W, C)` or `(C, H, W)` with `C` in {1, 3, 4}, holding uint8 values or floats in `[0, 1]`. Numpy arrays
            default to channels-last and torch tensors to channels-first when the layout is ambiguous.
        input_data_format (`str` or `ChannelDimension`, *optional*):
            Forces the channel layout of array/tensor inputs.

    Returns:
        `PIL.Image.Image`: the image in mode `"RGB"`.

    Raises:
        `ValueError`: if the input is not an image, is empty, or has an unsupported shape, dtype or value range.
    """
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise ValueError(f"Got an empty image of size {image.width}x{image.height} (width x height).")
        if image.mode.startswith(("I", "F")):  # 16- and 32-bit modes: `convert` would clip what lies past 255
            values = np.asarray(image)
            low, high = float(values.min()), float(values.max())
            if low < 0 or high > 255:
                raise ValueError(
                    f"A mode {image.mode!r} image must hold values in [0, 255], got values in [{low}, {high}]: "
                    "scale it to 8 bits first."
                )
        # Plain `convert("RGB")` (alpha dropped) is what the original OFA data pipeline does.
        return image if image.mode == "RGB" else image.convert("RGB")

    if isinstance(image, torch.Tensor):
        tensor = image.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype != torch.float64:
            tensor = tensor.float()  # numpy has no bfloat16
        array, channels_first_default = tensor.numpy(), True
    elif isinstance(image, np.ndarray):
        array, channels_first_default = image, False
    else:
        raise ValueError(
            f"Unsupported image type {_describe(image)}: expected a PIL.Image.Image, a numpy array or a torch tensor."
        )

    if array.size == 0:
        raise ValueError(f"Got an empty image array of shape {tuple(array.shape)}.")
    if array.ndim not in (2, 3):
        raise ValueError(
            f"Expected an image with 2 (H, W) or 3 (H, W, C) / (C, H, W) dimensions, got {array.ndim} dimensions "
            f"(shape {tuple(array.shape)}). Pass a batch as a list of images or one 4-D array."
        )

    if array.ndim == 3:
        axis = _channel_axis(array.shape, channels_first_default, input_data_format)
        array = np.moveaxis(array, axis, -1)
        if array.shape[-1] == 1:
            array = array[..., 0]
    array = np.ascontiguousarray(_array_to_uint8(array))
    # Going through PIL gives arrays exactly the same RGB conversion as PIL images ("L" -> gray copies, alpha dropped).
    return Image.fromarray(array).convert("RGB")


class OFAImageProcessor(PilBackend):
    r"""
    Image processor for OFA (PIL/NumPy backend).

    Every image is converted to RGB, resized to `(size["height"], size["width"])` with PIL bicubic filtering (the image
    is stretched: no crop and no aspect-ratio preservation), rescaled by 1/255 and normalized with mean = std = 0.5.
    The result matches torchvision's `Resize((R, R), BICUBIC) + ToTensor() + Normalize([0.5] * 3, [0.5] * 3)` used by
    the original OFA code.

    Accepted inputs: a PIL image of any mode, a numpy array (`(H, W)`, `(H, W, C)` or `(C, H, W)`, uint8 or float in
    `[0, 1]`), a torch tensor (same shapes, channels-first preferred), or a list/tuple of those (a batch). RGB
    conversion is always applied because OFA's ResNet stem takes 3 channels; `do_convert_rgb` is therefore ignored.

    Args:
        size (`dict[str, int]` or `int`, *optional*, defaults to `{"height": 384, "width": 384}`):
            Output size. An int `R` means `{"height": R, "width": R}`.
        resample (`PILImageResampling`, *optional*, defaults to `PILImageResampling.BICUBIC`):
            Resampling filter.
        image_mean (`list[float]`, *optional*, defaults to `[0.5, 0.5, 0.5]`):
            Per-channel mean subtracted after rescaling.
        image_std (`list[float]`, *optional*, defaults to `[0.5, 0.5, 0.5]`):
            Per-channel standard deviation used after rescaling.
    """

    model_input_names = ["pixel_values"]

    resample = PILImageResampling.BICUBIC
    size = {"height": 384, "width": 384}
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    rescale_factor = 1 / 255
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_center_crop = False
    do_pad = False

    def _validate_preprocess_kwargs(self, size: SizeDict | None = None, do_resize: bool | None = None, **kwargs):
        if kwargs.get("do_rescale") is False:  # every image becomes 8-bit first (floats in [0, 1] scaled up)
            raise ValueError(
                "OFAImageProcessor resizes 8-bit images with PIL, as OFA does, and always rescales them by 1/255 "
                "(float images in [0, 1] are read as such): drop `do_rescale=False`."
            )
        super()._validate_preprocess_kwargs(size=size, do_resize=do_resize, **kwargs)
        # OFA resizes to a fixed (height, width); "shortest_edge"-style sizes would give ragged batches.
        if do_resize and (size is None or not size.height or not size.width):
            raise ValueError(f"OFAImageProcessor needs `size` with 'height' and 'width' (or an int), got {size}.")

    def process_image(
        self,
        image: SingleImage,
        *args,
        input_data_format: str | ChannelDimension | None = None,
        **kwargs,
    ) -> np.ndarray:
        """Convert one raw image to a channels-first uint8 RGB array (the working format of the PIL backend)."""
        rgb = to_rgb_pil_image(image, input_data_format=input_data_format)
        return np.moveaxis(np.asarray(rgb, dtype=np.uint8), -1, 0)

    def _prepare_image_like_inputs(
        self,
        images: OFAImageInput,
        *args,
        expected_ndims: int = 3,
        **kwargs,
    ) -> list[np.ndarray]:
        # Replaces the base class' permissive flattening (which also treats nested lists as batches) with a strict
        # "one image, a flat list of images or a 4-D batch" contract and errors that point at the faulty image.
        if getattr(images, "ndim", 0) == 4:
            images = list(images)
        if isinstance(images, (list, tuple)):
            if len(images) == 0:
                raise ValueError("Got an empty list of images: pass at least one image.")
            processed = []
            for index, image in enumerate(images):
                try:
                    processed.append(self.process_image(image, *args, **kwargs))
                except ValueError as error:
                    raise ValueError(f"Invalid image at index {index} of the batch: {error}") from None
            return processed
        return [self.process_image(images, *args, **kwargs)]


def add_ofa_special_tokens(
    tokenizer: PreTrainedTokenizerBase, num_codes: int = OFA_NUM_CODES, num_bins: int = OFA_NUM_BINS
) -> int:
    """
    Append OFA's `<code_0>`..`<code_{num_codes-1}>` and `<bin_0>`..`<bin_{num_bins-1}>` tokens to a BART tokenizer.

    With the official BART files (50265 tokens) this gives `<code_0>` = 50265, `<bin_0>` = 58457 and a vocabulary of
    59457 tokens, as in the official OFA checkpoints. They are added as ordinary (non-special) tokens, like OFA's own
    Hugging Face tokenizer does, so `skip_special_tokens=True` keeps them in decoded text. Calling it again is a no-op.

    Note: a space before an added token is tokenized separately (`" <bin_0>"` gives `[1437, 58457]`); write location
    sequences without spaces (`"<bin_1><bin_2>"`) to get fairseq's ids.

    Returns:
        `int`: the number of tokens actually added.

    Raises:
        `ValueError`: if the resulting code/bin ids are not one contiguous block (e.g. some were already present with
        other ids), since the model's embedding rows would then not match.
    """
    codes = [f"<code_{i}>" for i in range(num_codes)]
    bins = [f"<bin_{i}>" for i in range(num_bins)]
    added = tokenizer.add_tokens(codes) + tokenizer.add_tokens(bins)

    ids = tokenizer.convert_tokens_to_ids(codes + bins)
    if ids and ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(
            "OFA code/bin tokens did not get contiguous ids (the tokenizer already contained some of them with other "
            "ids); start from the plain BART tokenizer files."
        )
    return added


def prompt_text(text: str) -> str:
    """OFA's prompts and targets start with a space (BPE words carry their leading space); an empty text stays empty."""
    return text if not text or text[0].isspace() else " " + text


def checked_texts(text: Any, name: str) -> list[str] | None:
    """`text` (a string or a list of strings) as a list of OFA texts, each with its leading space; None stays None."""
    if text is None:
        return None
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, (list, tuple)):
        raise ValueError(f"`{name}` must be a string or a list of strings, got {_describe(text)}.")
    if len(texts) == 0:
        raise ValueError(f"`{name}` is an empty list: pass at least one string.")
    for index, sample in enumerate(texts):
        if not isinstance(sample, str):
            raise ValueError(
                f"`{name}` must be a string or a list of strings, got {_describe(sample)} at index {index}."
            )
    return [prompt_text(sample) for sample in texts]


class OFAProcessor(ProcessorMixin):
    r"""
    Processor for OFA: an [`OFAImageProcessor`] and a BART byte-level BPE tokenizer.

    Text follows OFA's convention: a prompt starts with a space, `" what does the image describe?"`, encoded as
    `<s> text </s>`; a text without one gets it (the official code adds it to every question; without it the BPE
    words differ from training's). Batches are always padded on the right, because OFA's text positions run `0..L-1`
    whatever the padding. `text_target` gives `labels` as the model takes them: the target's tokens and `</s>`, without
    `<s>` (the decoder starts from it), padded with -100.

    Args:
        image_processor ([`OFAImageProcessor`]):
            The image processor.
        tokenizer ([`PreTrainedTokenizerBase`]):
            The BART tokenizer (in Transformers 5, `BartTokenizer` is `RobertaTokenizer`), usually with OFA's code and
            bin tokens added (see [`OFAProcessor.build_tokenizer`]).
    """

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        # Sub-processors are discovered by ProcessorMixin from this signature (Transformers 5 style).
        super().__init__(image_processor, tokenizer, **kwargs)

    @classmethod
    def build_tokenizer(
        cls, tokenizer_dir: str, num_codes: int = OFA_NUM_CODES, num_bins: int = OFA_NUM_BINS
    ) -> PreTrainedTokenizerBase:
        """
        Load BART's `vocab.json`/`merges.txt` from `tokenizer_dir` and append OFA's code and bin tokens.

        `from_pretrained` is used on purpose: in Transformers 5, `BartTokenizer(vocab_file=..., merges_file=...)`
        silently builds an almost empty tokenizer.
        """
        tokenizer = BartTokenizer.from_pretrained(tokenizer_dir)
        add_ofa_special_tokens(tokenizer, num_codes=num_codes, num_bins=num_bins)
        return tokenizer

    def __call__(
        self,
        images: OFAImageInput | None = None,
        text: str | list[str] | None = None,
        text_target: str | list[str] | None = None,
        return_tensors: str | None = None,
        padding: bool | str = True,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        **kwargs,
    ) -> BatchFeature:
        """
        Tokenize `text` and/or preprocess `images`.

        Args:
            images (`PIL.Image.Image`, `np.ndarray`, `torch.Tensor` or a list of them, *optional*):
                Image(s) for [`OFAImageProcessor`].
            text (`str` or `list[str]`, *optional*):
                Prompt(s), each encoded as `<s> text </s>` (with a leading space added where missing).
            text_target (`str` or `list[str]`, *optional*):
                Target(s) for training: `labels`, each target's tokens then `</s>`, padded with -100 (truncated as the
                prompts are).
            return_tensors (`str`, *optional*):
                `"pt"` for torch tensors, `"np"` for numpy arrays, `None` for lists.
            padding (`bool` or `str`, *optional*, defaults to `True`):
                Padding strategy (`True` = longest in the batch). Padding is always on the right.
            truncation (`bool` or `str`, *optional*):
                Truncation strategy; by default, truncate only when `max_length` is given.
            max_length (`int`, *optional*):
                Maximum text length (in tokens, including `<s>` and `</s>`).
            kwargs:
                Image processor options (`size`, `resample`, ...) go to the image processor, tokenizer options to the
                tokenizer, also when nested as `images_kwargs` / `text_kwargs` / `common_kwargs`; others are ignored
                with a warning.

        Returns:
            [`BatchFeature`]: `input_ids` and `attention_mask` when text is given, `labels` when targets are,
            `pixel_values` when images are.

        Raises:
            `ValueError`: if neither input is given, `text` is not a string or list of strings, an image is invalid,
            the image and text batch sizes differ, or an option of `generate` (an exit knob, `max_new_tokens`, ...)
            is given.
        """
        if images is None and text is None and text_target is None:
            raise ValueError("OFAProcessor needs at least one of `images`, `text` or `text_target`, got none.")

        image_kwargs, text_kwargs = self.split_kwargs(kwargs)
        texts, targets = checked_texts(text, "text"), checked_texts(text_target, "text_target")
        if texts is not None and targets is not None and len(texts) != len(targets):
            raise ValueError(f"Got {len(texts)} text(s) but {len(targets)} target(s): give one target per text.")
        batch = texts if texts is not None else targets
        if batch is not None and images is not None:
            # A list, or one array or tensor: [batch, ...] when 4-D, else a single image.
            num_images = len(images) if isinstance(images, (list, tuple)) else 1
            num_images = images.shape[0] if getattr(images, "ndim", 0) == 4 else num_images
            if num_images != len(batch):
                raise ValueError(
                    f"Got {num_images} image(s) but {len(batch)} text(s): OFA pairs exactly one image with each text."
                )

        data = {}
        # OFA pads on the right (the model takes either side); by default it truncates only to a given `max_length`.
        options = dict(padding=padding, truncation=truncation, max_length=max_length, padding_side="right")
        options.update(text_kwargs)
        if options["truncation"] is None:
            options["truncation"] = options["max_length"] is not None
        if texts is not None:
            data.update(self.tokenizer(texts, **options))
        if targets is not None:
            tokens = self.tokenizer(targets, **{**options, "padding_side": "right"})
            data["labels"] = [
                [token if real else -100 for token, real in zip(ids[1:], mask[1:], strict=True)]  # <s> dropped
                for ids, mask in zip(tokens["input_ids"], tokens["attention_mask"], strict=True)
            ]
        if images is not None:
            data.update(self.image_processor(images, **image_kwargs))

        return BatchFeature(data=data, tensor_type=return_tensors)

    def split_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(image processor options, tokenizer options) of `kwargs`. `generate`'s options are a ValueError (a pipeline
        hands the processor its call's unknown keyword arguments); others are ignored with a warning."""
        groups = ("images_kwargs", "text_kwargs", "common_kwargs")  # ProcessorMixin's grouped form
        flat = {key: value for key, value in kwargs.items() if key not in groups}
        for group in (kwargs[name] for name in groups if name in kwargs):  # each key goes where its name says
            if not isinstance(group, dict):
                raise ValueError(f"`{'`, `'.join(groups)}` must be dicts, got {_describe(group)}.")
            flat.update(group)
        kwargs = flat
        image_kwarg_names = set(self.image_processor.valid_kwargs.__annotations__)
        image_kwargs = {key: value for key, value in kwargs.items() if key in image_kwarg_names}
        text_kwargs = {key: value for key, value in kwargs.items() if key in TextKwargs.__annotations__}
        unknown = sorted(set(kwargs) - set(image_kwargs) - set(text_kwargs))
        for_generate = [key for key in unknown if key in GENERATE_OPTIONS]
        if for_generate:
            raise ValueError(
                f"The processor does not take `generate`'s options {for_generate}: pass them to `model.generate`, or "
                "in a pipeline's `generate_kwargs`."
            )
        for key in unknown:  # as stock processors do
            logger.warning(f"Keyword argument `{key}` is not a valid argument for this processor and will be ignored.")
        return image_kwargs, text_kwargs

    def batch_decode(self, *args, **kwargs) -> list[str]:
        """Forwards to the tokenizer's `batch_decode`."""
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs) -> str:
        """Forwards to the tokenizer's `decode`."""
        return self.tokenizer.decode(*args, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        """Names of the model inputs produced by this processor: text inputs then `pixel_values`."""
        names = list(self.tokenizer.model_input_names) + list(self.image_processor.model_input_names)
        return list(dict.fromkeys(names))


# Registering only sets a class attribute (no global state), so it is safe at import time. It makes `save_pretrained`
# copy this file next to the configs and write the `auto_map` entries, so that `AutoProcessor.from_pretrained(...,
# trust_remote_code=True)` and `AutoImageProcessor.from_pretrained(..., trust_remote_code=True)` find these classes.
OFAImageProcessor.register_for_auto_class("AutoImageProcessor")
OFAProcessor.register_for_auto_class("AutoProcessor")


__all__ = ["OFAImageProcessor", "OFAProcessor", "add_ofa_special_tokens", "prompt_text", "to_rgb_pil_image"]
