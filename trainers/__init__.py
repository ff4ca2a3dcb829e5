"""Fine-tuning OFA's exits: `EarlyExitTrainer` and its `EarlyExitTrainingArguments`."""

from .discriminator import ExitDiscriminators
from .early_exit_config import EXIT_LOSSES, EarlyExitTrainingArguments
from .early_exit_trainer import RECIPE_FILE, EarlyExitTrainer

__all__ = ["EXIT_LOSSES", "RECIPE_FILE", "EarlyExitTrainer", "EarlyExitTrainingArguments", "ExitDiscriminators"]
