"""Convert official OFA checkpoints to hf-earlyexit's format.

Two sources are read:
- the official Hugging Face port (`OFA-Sys/OFA`, `feature/add_transformers`): a folder with `config.json` and
  `pytorch_model.bin` or `model.safetensors`;
- a fairseq checkpoint (`*.pt`, weights under `"model"`), whose key names are renamed the way the official
  converter does.

The architecture is read from the weights themselves (layer counts, widths, heads, ResNet depth, bucket sizes),
so it cannot disagree with them; the port's `config.json`, when present, adds dropout rates and token ids and
must agree with what the weights say. Deterministic index buffers and fairseq `version` keys are dropped;
every other key must be used by the model, and every model key must be in the checkpoint.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .loading import build_processor
from .modeling import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from .modeling.configuration_ofa import PATCH_STEM, RESNET_LAYERS

# fairseq -> HF names, as chained substring replacements. The order matters: applied first, `attn_ln` would turn
# `self_attn_ln` into `self_self_attn_mid_layer_norm`.
FAIRSEQ_RENAMES = (
    ("self_attn_ln", "self_attn_mid_layer_norm"),
    ("ffn_layernorm", "ffn_layer_norm"),
    ("cross_attn_ln", "cross_attn_mid_layer_norm"),
    ("encoder_attn", "cross_attn"),
    ("attn_ln", "self_attn_mid_layer_norm"),
)
# Pure functions of the config, rebuilt by the model from position ids.
INDEX_BUFFERS = (
    "encoder.token_rp_bucket",
    "encoder.image_rp_bucket",
    "decoder.token_rp_bucket",
    "decoder.image_rp_bucket",
    "decoder.image_position_idx",
)
TIED_KEYS = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "decoder.output_projection.weight")
# Fields of the official port's config.json that configure nothing in the architecture, dropped: generation settings
# (the port's beams and lengths; our generation config keeps the exit defaults, and a call gives its own decoding)
# and transformers-4 bookkeeping.
IGNORED_PORT_FIELDS = {
    "_name_or_path",
    "add_cross_attention",
    "architectures",
    "bad_words_ids",
    "chunk_size_feed_forward",
    "classifier_dropout",
    "cross_attention_hidden_size",
    "diversity_penalty",
    "do_sample",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty",
    "finetuning_task",
    "forced_bos_token_id",
    "id2label",
    "is_decoder",
    "label2id",
    "length_penalty",
    "max_length",
    "min_length",
    "model_type",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_hidden_layers",
    "num_return_sequences",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "prefix",
    "problem_type",
    "pruned_heads",
    "remove_invalid_values",
    "repetition_penalty",
    "resnet_model_path",
    "return_dict",
    "return_dict_in_generate",
    "sep_token_id",
    "task_specific_params",
    "temperature",
    "tie_encoder_decoder",
    "tokenizer_class",
    "top_k",
    "top_p",
    "torch_dtype",
    "dtype",
    "torchscript",
    "transformers_version",
    "typical_p",
    "use_bfloat16",
    "use_cache",
}
# The port's name for our field.
PORT_FIELD_RENAMES = {"share_decoder_input_output_embed": "tie_word_embeddings"}


def rename_fairseq_key(key: str) -> str:
    for old, new in FAIRSEQ_RENAMES:
        key = key.replace(old, new)
    return key


def load_official_checkpoint(source: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Read weights (renamed to HF names) and, for the HF port, its config.json.

    `source` is a fairseq `.pt` file, or a folder with `model.safetensors` / `pytorch_model.bin` (HF port) or a
    single `.pt` file (fairseq). Pickled files are read with `weights_only=True`.
    """
    source = Path(source)
    if not source.exists():
        raise ValueError(f"No checkpoint at {source}.")
    if source.is_dir():
        port_config = read_port_config(source / "config.json")
        if (source / "model.safetensors").exists():
            try:
                return load_file(source / "model.safetensors"), port_config
            except SafetensorError as error:
                raise ValueError(
                    f"{source / 'model.safetensors'} is not a readable safetensors file ({error})."
                ) from None
        if (source / "pytorch_model.bin").exists():
            return _torch_load(source / "pytorch_model.bin"), port_config
        fairseq_files = sorted(source.glob("*.pt"))
        if len(fairseq_files) != 1:
            raise ValueError(
                f"{source} holds no model.safetensors, pytorch_model.bin or single fairseq .pt checkpoint."
            )
        source = fairseq_files[0]
    checkpoint = _torch_load(source)
    weights = checkpoint.get("model", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(weights, dict):
        raise ValueError(f"{source} holds a {type(checkpoint).__name__}, not a checkpoint (a dict of weights).")
    return {rename_fairseq_key(key): value for key, value in weights.items()}, None


def read_port_config(path: Path) -> dict | None:
    """The HF port's config.json, None when absent. ValueError naming the file when it is not JSON, or when it is an
    hf-earlyexit model's (nothing to convert)."""
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None
    if isinstance(config, dict) and config.get("model_type") == OFAEarlyExitConfig.model_type:
        raise ValueError(f"{path.parent} is an hf-earlyexit model already: load it as it is, nothing to convert.")
    return config


def _torch_load(path: Path) -> dict:
    # fairseq pickles its training arguments as an argparse.Namespace next to the weights.
    with torch.serialization.safe_globals([argparse.Namespace]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(
                f"Could not read {path} with weights_only=True ({str(error).splitlines()[0]}). Re-save just its "
                "weights, e.g. torch.save(checkpoint['model'], 'weights.pt'), and convert that file."
            ) from error


def clean_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the index buffers and fairseq's `version` / `_float_tensor` keys."""
    cleaned = {
        key: value
        for key, value in state_dict.items()
        if key not in INDEX_BUFFERS and "version" not in key and "_float_tensor" not in key
    }
    if not any(key in cleaned for key in TIED_KEYS):
        raise ValueError(f"The checkpoint has no token embedding (none of {list(TIED_KEYS)}).")
    return cleaned


def _tied(state_dict: dict[str, torch.Tensor]) -> bool:
    copies = [state_dict[key] for key in TIED_KEYS if key in state_dict]
    return len(copies) == 1 or all(torch.equal(copies[0], other) for other in copies[1:])


def _layer_count(state_dict: dict[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    indices = {int(match.group(1)) for key in state_dict if (match := pattern.match(key))}
    return max(indices) + 1 if indices else 0


def _shape(state_dict: dict[str, torch.Tensor], key: str) -> torch.Size:
    if key not in state_dict:
        raise ValueError(f"The checkpoint lacks {key!r}, which the architecture is read from.")
    return state_dict[key].shape


def _image_stem(state_dict: dict[str, torch.Tensor]) -> str:
    blocks = tuple(_layer_count(state_dict, f"encoder.embed_images.layer{stage}") for stage in (1, 2, 3))
    for name, layout in RESNET_LAYERS.items():
        if blocks == layout:
            return name
    if blocks == (0, 0, 0) and "encoder.embed_images.conv2.weight" in state_dict:
        return PATCH_STEM
    raise ValueError(f"Unrecognised image stem: ResNet stages with {blocks} blocks.")


def infer_config(state_dict: dict[str, torch.Tensor], port_config: dict | None = None) -> OFAEarlyExitConfig:
    """The architecture the weights describe, plus the port config's non-architectural fields (which must agree)."""
    embedding = next(state_dict[key] for key in TIED_KEYS if key in state_dict)
    vocab_size, d_model = embedding.shape
    inferred = {
        "vocab_size": vocab_size,
        "d_model": d_model,
        "encoder_layers": _layer_count(state_dict, "encoder.layers"),
        "decoder_layers": _layer_count(state_dict, "decoder.layers"),
        "encoder_ffn_dim": _shape(state_dict, "encoder.layers.0.fc1.weight")[0],
        "decoder_ffn_dim": _shape(state_dict, "decoder.layers.0.fc1.weight")[0],
        "encoder_attention_heads": _shape(state_dict, "encoder.token_rel_pos_table_list.0.weight")[1],
        "decoder_attention_heads": _shape(state_dict, "decoder.token_rel_pos_table_list.0.weight")[1],
        "max_position_embeddings": _shape(state_dict, "encoder.embed_positions.weight")[0] - 2,
        "token_bucket_size": (_shape(state_dict, "encoder.token_rel_pos_table_list.0.weight")[0] + 1) // 2,
        "image_bucket_size": math.isqrt(_shape(state_dict, "encoder.embed_image_positions.weight")[0] - 1),
        "resnet_type": _image_stem(state_dict),
        "normformer": "encoder.layers.0.self_attn.c_attn" in state_dict,
        "add_type_embedding": "encoder.type_embedding.weight" in state_dict,
        "layernorm_embedding": "encoder.layernorm_embedding.weight" in state_dict,
        "patch_layernorm_embedding": "encoder.patch_layernorm_embedding.weight" in state_dict,
        "code_layernorm_embedding": "decoder.code_layernorm_embedding.weight" in state_dict,
        "tie_word_embeddings": _tied(state_dict),
    }
    if port_config is None:
        return OFAEarlyExitConfig(**inferred)

    known = {field.name for field in fields(OFAEarlyExitConfig)}
    renamed = {PORT_FIELD_RENAMES.get(key, key): value for key, value in port_config.items()}
    unknown = sorted(key for key in renamed if key not in known and key not in IGNORED_PORT_FIELDS)
    if unknown:
        raise ValueError(f"config.json has fields this converter does not know: {unknown}.")
    settings = {key: value for key, value in renamed.items() if key in known and key not in IGNORED_PORT_FIELDS}
    disagreeing = {
        key: (settings[key], value) for key, value in inferred.items() if key in settings and settings[key] != value
    }
    if disagreeing:
        details = ", ".join(f"{key}: config {a!r} vs weights {b!r}" for key, (a, b) in disagreeing.items())
        raise ValueError(f"config.json disagrees with the weights: {details}.")
    return OFAEarlyExitConfig(**{**settings, **inferred})


def load_converted_model(
    state_dict: dict[str, torch.Tensor], config: OFAEarlyExitConfig
) -> EarlyExitOFAForConditionalGeneration:
    """Build the model and load every weight strictly, listing any key the checkpoint or the model lacks."""
    model = EarlyExitOFAForConditionalGeneration(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:  # one tensor under three names: any saved copy fills the others
        source = next(state_dict[key] for key in TIED_KEYS if key in state_dict)
        state_dict = {**{key: source for key in TIED_KEYS}, **state_dict}
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint does not match the model. Missing keys: {missing}; unexpected keys: {unexpected}."
        )
    shapes = [
        f"{key}: {tuple(state_dict[key].shape)} vs {tuple(value.shape)}"
        for key, value in model.state_dict().items()
        if state_dict[key].shape != value.shape
    ]
    if shapes:
        raise ValueError(f"Checkpoint tensors have the wrong shapes (checkpoint vs model): {shapes}.")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def check_new_folder(target: str | Path, source: str | Path) -> None:
    """ValueError unless `target` is a folder to make, or an empty one: a conversion never writes over earlier work
    (a model there would keep its other files beside the new weights, and `source` itself would be lost)."""
    target = Path(target)
    if target.exists() and target.resolve() == Path(source).resolve():
        raise ValueError(f"Converting {source} into itself would overwrite the checkpoint: give another folder.")
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        raise ValueError(f"{target} already holds files: convert into a new or empty folder.")


def convert_checkpoint(
    source: str | Path,
    target: str | Path,
    progress: bool = False,
    tokenizer_dir: str | Path | None = None,
    image_size: int = 384,
) -> EarlyExitOFAForConditionalGeneration:
    """Convert an official OFA checkpoint at `source` and save it (safetensors + remote code) to `target`, a new or
    empty folder; with `tokenizer_dir`, the processor too (`build_processor`, square `image_size` images), checked
    against the vocabulary before anything is written. `progress`: one line on stderr once the checkpoint has been
    read, before converting and saving."""
    check_new_folder(target, source)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ValueError(f"No tokenizer folder at {tokenizer_dir}.")
    state_dict, port_config = load_official_checkpoint(source)
    if progress:
        print(f"read {source}; converting and saving to {target} ...", file=sys.stderr, flush=True)
    state_dict = clean_state_dict(state_dict)
    model = load_converted_model(state_dict, infer_config(state_dict, port_config))
    processor = build_processor(tokenizer_dir, image_size, model.config) if tokenizer_dir else None
    model.save_pretrained(target)
    if processor is not None:
        processor.save_pretrained(target)
    return model
