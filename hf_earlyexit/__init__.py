"""hf-earlyexit: early exits for OFA vision-language encoder-decoders, native in Transformers 5."""

from .modeling import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig

__all__ = ["EarlyExitOFAForConditionalGeneration", "OFAEarlyExitConfig"]
