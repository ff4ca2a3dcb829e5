"""EarlyExitTrainer under `accelerate launch` with 2 CPU processes (gloo): the ranks end with identical models and
discriminators, and only the main process talks to the Hub."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("distributed_training.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_process_adversarial_training_ends_identical_on_both_ranks(tmp_path):
    # `--multi_gpu` picks accelerate's torchrun launcher; on a machine without GPUs (`use_cpu=True`) it runs gloo.
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), str(SCRIPT), str(tmp_path),
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert ranks[0]["backend"] == "gloo"
    assert ranks[0]["model"] != ranks[0]["initial"]
    assert ranks[0]["model"] == ranks[1]["model"]
    assert ranks[0]["discriminators"] == ranks[1]["discriminators"]
    assert ranks[0]["logged"] == ranks[1]["logged"] and "loss_disc" in ranks[0]["logged"][0]
    assert ranks[0]["hub_calls"] == ["create_repo", "upload_folder"]
    assert ranks[1]["hub_calls"] == []
