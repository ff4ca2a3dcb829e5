"""MuE: the task loss on every decoder layer through the shared final LayerNorm and head (no new parameters), so
any layer can answer; at inference the similarity exit decides per token (and per encoder stream).

    python examples/train_mue_layerwise.py --output-dir out/mue --max-steps 3000 --learning-rate 1e-3
    accelerate launch --config_file examples/accelerate_config.yaml examples/train_mue_layerwise.py \
        --model-dir out/my-ofa --dataset parquet:data/vqa --output-dir out/mue
"""

import argparse

from hf_earlyexit.cli import add_training_arguments
from hf_earlyexit.training import fine_tune

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    options = parser.parse_args()
    # MuE trains the modality-decomposed encoder, whose image and text streams can exit separately.
    fine_tune(options, {"decompose_encoder_modalities": True}, exit_loss="layerwise", exit_loss_weights="uniform")
