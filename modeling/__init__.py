"""The model as it ships next to the weights: torch + transformers only, relative imports only."""

from .configuration_ofa import OFAEarlyExitConfig
from .modeling_ofa import EarlyExitOFAForConditionalGeneration, OFAEncoderOutput, OFAPreTrainedModel

__all__ = ["OFAEarlyExitConfig", "EarlyExitOFAForConditionalGeneration", "OFAEncoderOutput", "OFAPreTrainedModel"]
