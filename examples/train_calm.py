"""CALM: the task loss on every decoder layer through the shared final LayerNorm and head, weighted up with depth.

At inference the head's top-2 softmax margin decides per token, and `propagate` fills the layers a token skipped
(Schuster et al., 2022). In docs/methods.md this recipe saved the most time at equal quality.

    python examples/train_calm.py --output-dir out/calm --max-steps 3000 --learning-rate 1e-3
"""

import argparse

from hf_earlyexit.cli import add_training_arguments
from hf_earlyexit.training import fine_tune

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    options = parser.parse_args()
    # CALM's inference, saved in the model config: a later `calibrate --write` saves the setting it picks (thresholds,
    # policy, `propagate`) in the generation config, which outranks these.
    inference = {"exit_policy": "margin", "kv_strategy": "propagate"}
    fine_tune(options, inference, exit_loss="layerwise", exit_loss_weights="increasing")
