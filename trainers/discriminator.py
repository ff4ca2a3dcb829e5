"""BLIPEE's feature discriminators: one per exit, telling the last layer's features from the exit's.

They exist only while training, outside the model: `EarlyExitTrainer` builds them, prepares them with Accelerate,
steps them with their own optimizer and saves them in its checkpoints.
"""

import torch
from torch import nn


class ExitDiscriminators(nn.Module):
    """One MLP per exit: d_model -> hidden -> LeakyReLU -> 1 logit ("this feature comes from the last layer")."""

    def __init__(self, num_exits: int, d_model: int, hidden_size: int):
        super().__init__()
        self.discriminators = nn.ModuleList(
            nn.Sequential(nn.Linear(d_model, hidden_size), nn.LeakyReLU(0.2), nn.Linear(hidden_size, 1))
            for _ in range(num_exits)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [exits, tokens, d_model], exit j's for discriminator j -> logits [exits, tokens], in the
        discriminators' dtype (float32 beside a bfloat16 model: the features are cast, their gradients cast back)."""
        features = features.to(self.discriminators[0][0].weight.dtype)
        return torch.stack([d(x).squeeze(-1) for d, x in zip(self.discriminators, features, strict=True)])


__all__ = ["ExitDiscriminators"]
