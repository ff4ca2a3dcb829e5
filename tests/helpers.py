"""Test helpers: the ../shared reference files and tiny models."""

import os
import random
from pathlib import Path

import pytest
import torch

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from hf_earlyexit.modeling.exit_knobs import NO_EXIT

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_EARLYEXIT_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A file or folder under ../shared (or $HF_EARLYEXIT_SHARED); the test is skipped when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: the project's shared/ folder (or $HF_EARLYEXIT_SHARED) is not beside the repo")
    return path


def tiny_config(**overrides) -> OFAEarlyExitConfig:
    settings = dict(
        vocab_size=120,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        resnet_type="patch",
        dropout=0.0,
    )
    return OFAEarlyExitConfig(**{**settings, **overrides})


def tiny_model(seed: int = 1, attn_implementation: str = "eager", **overrides) -> EarlyExitOFAForConditionalGeneration:
    """A tiny model initialised like the reference fixture, so greedy decoding gives varied tokens.

    With small weights a tied-embedding decoder just repeats one token; these gains (fc2 x3, position q/k x2,
    embeddings and relative tables 0.5) are the ones the official-code fixture uses for the same reason.
    """
    torch.manual_seed(seed)
    model = EarlyExitOFAForConditionalGeneration(tiny_config(**overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("c_attn") or (name.endswith(".weight") and "bn" in name):
                parameter.copy_(
                    1 + 0.1 * torch.randn_like(parameter)
                    if name.endswith(("weight", "c_attn"))
                    else 0.1 * torch.randn_like(parameter)
                )
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
            elif "embed" in name or "rel_pos_table" in name:
                parameter.normal_(0.0, 0.5)
            else:
                gain = 3.0 if "fc2" in name else 2.0 if "pos_q" in name or "pos_k" in name else 1.0
                parameter.normal_(0.0, gain / parameter[0].numel() ** 0.5)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def tiny_inputs(batch: int = 2, text_length: int = 7, image_size: int = 64, seed: int = 0, pad_last: int = 2):
    """Random ids (no special ids inside), right-padded last row, and random pixels."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 120, (batch, text_length), generator=generator)
    input_ids[:, 0] = 0
    input_ids[:, -1] = 2
    attention_mask = torch.ones_like(input_ids)
    if pad_last:
        input_ids[-1, -pad_last - 1] = 2
        input_ids[-1, -pad_last:] = 1
        attention_mask[-1, -pad_last:] = 0
    pixel_values = torch.randn(batch, 3, image_size, image_size, generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def emitted_token(model, inputs: dict, rng: random.Random, new_tokens: int) -> int:
    """A token of the full model's greedy output on `inputs` (its decoder input and `new_tokens` new ones past the
    start token), drawn by `rng`: as an end token, it ends rows apart."""
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **NO_EXIT)
    return rng.choice(tokens[:, 1:].flatten().tolist())
