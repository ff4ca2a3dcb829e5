"""BLIPEE without labels: exit transformer layers learn the frozen final layer's distribution (temperature-scaled
KL). No answer needs to be right: the target column only feeds the decoder (the model's own captions will do).

    python examples/train_blipee_distill.py --model-dir out/ofa-finetuned --output-dir out/blipee-kd
"""

import argparse

from hf_earlyexit.cli import add_training_arguments, parse_layers
from hf_earlyexit.training import fine_tune

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--exit-layers", default="1,2,3", help="decoder layers that get an exit layer")
    parser.add_argument("--temperature", type=float, default=2.0)
    options = parser.parse_args()
    fine_tune(
        options,
        {"exit_transformer_layers": parse_layers(options.exit_layers)},
        exit_loss="distill",
        distill_temperature=options.temperature,
        freeze_backbone=True,
    )
