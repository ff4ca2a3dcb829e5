"""Run by test_distributed.py under `accelerate launch` with 2 CPU processes (gloo): adversarial training with
gradient accumulation, then `push_to_hub` with a recording Hub client. Each rank writes its parameters' digest and
the Hub calls it made to OUT_DIR/rank{N}.json."""

import hashlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.helpers

from hf_earlyexit import EarlyExitTrainer  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402
from tests.trainers.test_early_exit_trainer import TinyCaptions, arguments  # noqa: E402


class RecordingHub:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append("create_repo")
        return mock.Mock(repo_id=repo_id)

    def upload_folder(self, **kwargs):
        self.calls.append("upload_folder")


def digest(module: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for name, parameter in sorted(module.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(parameter.detach().cpu().numpy().tobytes())
    return hasher.hexdigest()


def main(out_dir: Path) -> None:
    model = tiny_model(decoder_layers=4, exit_transformer_layers=[1, 3])
    initial = digest(model)
    args = arguments(
        out_dir,
        exit_loss="adversarial",
        freeze_backbone=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        hub_model_id="someone/tiny-ofa-ee",
    )
    trainer = EarlyExitTrainer(model=model, args=args, train_dataset=TinyCaptions(size=16))
    trainer.train()
    hub = RecordingHub()
    with mock.patch("transformers.trainer.hf_api", return_value=hub):
        trainer.push_to_hub()
    rank = trainer.accelerator.process_index
    result = {
        "world_size": trainer.accelerator.num_processes,
        "backend": torch.distributed.get_backend(),
        "initial": initial,
        "model": digest(trainer.model),
        "discriminators": digest(trainer.accelerator.unwrap_model(trainer.discriminators)),
        "hub_calls": hub.calls,
        "logged": [entry for entry in trainer.state.log_history if "loss" in entry],
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
