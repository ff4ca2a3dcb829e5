"""BLIPEE: exit transformer layers at chosen decoder layers, trained on a frozen backbone as generators against
feature discriminators (final-layer vs exit features), plus cross-entropy with labels.

    python examples/train_blipee_adversarial.py --model-dir out/ofa-finetuned --output-dir out/blipee
"""

import argparse

from hf_earlyexit.cli import add_training_arguments, parse_layers
from hf_earlyexit.training import fine_tune

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--exit-layers", default="1,2,3", help="decoder layers that get an exit layer")
    parser.add_argument("--adversarial-weight", type=float, default=0.1)
    options = parser.parse_args()
    fine_tune(
        options,
        {"exit_transformer_layers": parse_layers(options.exit_layers)},
        exit_loss="adversarial",
        adversarial_weight=options.adversarial_weight,
        freeze_backbone=True,
    )
