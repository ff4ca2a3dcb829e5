"""DEED: deep supervision of every decoder layer through small adaptation modules before the shared head; at
inference the head's confidence decides per token, and `kv_strategy="recompute"` completes skipped layers later.

    python examples/train_deed_deep_supervision.py --output-dir out/deed --max-steps 3000 --learning-rate 1e-3
"""

import argparse

from hf_earlyexit.cli import add_training_arguments
from hf_earlyexit.training import fine_tune

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--adapter-dim", type=int, default=64, help="bottleneck width of the adaptation modules")
    options = parser.parse_args()
    # DEED's inference, saved in the model config: the exit head's confidence decides, skipped layers are recomputed.
    # A later `calibrate --write` saves the setting it picks (with `propagate`, which it measured) in the generation
    # config, which outranks these: pass `kv_strategy="recompute"` to `generate` to keep DEED's.
    inference = {"exit_policy": "confidence", "kv_strategy": "recompute"}
    fine_tune(options, {"exit_adapter_dim": options.adapter_dim, **inference}, exit_loss="deep_supervision")
