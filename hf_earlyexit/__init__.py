"""hf-earlyexit: early exits for OFA vision-language encoder-decoders, native in Transformers 5."""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageTextToText,
    AutoModelForSeq2SeqLM,
    AutoProcessor,
)

from .modeling import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from .modeling.early_exit_cache import EarlyExitCache
from .modeling.exit_controllers import (
    ConfidenceExit,
    ExitController,
    ExitControllerList,
    ExitState,
    FixedLayerExit,
    PatienceExit,
    SimilarityExit,
    ThresholdExit,
)
from .modeling.exit_knobs import NO_EXIT
from .modeling.generation_early_exit import EarlyExitSettings
from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor
from .publishing import PublishError, publish
from .trainers import EarlyExitTrainer, EarlyExitTrainingArguments

# With the package imported, the Auto classes resolve our model type without remote code.
AutoConfig.register(OFAEarlyExitConfig.model_type, OFAEarlyExitConfig, exist_ok=True)
AutoModel.register(OFAEarlyExitConfig, EarlyExitOFAForConditionalGeneration, exist_ok=True)
AutoModelForSeq2SeqLM.register(OFAEarlyExitConfig, EarlyExitOFAForConditionalGeneration, exist_ok=True)
AutoModelForImageTextToText.register(OFAEarlyExitConfig, EarlyExitOFAForConditionalGeneration, exist_ok=True)
AutoImageProcessor.register(OFAEarlyExitConfig, slow_image_processor_class=OFAImageProcessor, exist_ok=True)
AutoProcessor.register(OFAEarlyExitConfig, OFAProcessor, exist_ok=True)

__all__ = [
    "ConfidenceExit",
    "EarlyExitCache",
    "EarlyExitSettings",
    "EarlyExitTrainer",
    "EarlyExitTrainingArguments",
    "ExitController",
    "ExitControllerList",
    "ExitState",
    "FixedLayerExit",
    "NO_EXIT",
    "PatienceExit",
    "PublishError",
    "SimilarityExit",
    "ThresholdExit",
    "EarlyExitOFAForConditionalGeneration",
    "OFAEarlyExitConfig",
    "OFAImageProcessor",
    "OFAProcessor",
    "publish",
]
