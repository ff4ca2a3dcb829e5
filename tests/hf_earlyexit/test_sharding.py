"""`eval` and `calibrate` under `accelerate launch` with 2 CPU processes (gloo): the processes share the batches,
the main process prints one report, and it equals the one-process report."""

import json
import os
import subprocess
import sys

import pytest

from hf_earlyexit.cli import main
from hf_earlyexit.loading import EMBEDDED_MODEL_DIR
from tests.trainers.test_distributed import free_port

EVAL = ["eval", str(EMBEDDED_MODEL_DIR), "--task", "vqa", "--split", "validation", "--samples", "24"]
EVAL += ["--batch-size", "4", "--exit-policy", "confidence", "--exit-threshold", "0.8", "--against-full", "--json"]
# One setting, so that the timed part costs cannot reorder the fixed sequence between the runs.
CALIBRATE = ["calibrate", str(EMBEDDED_MODEL_DIR), "--tasks", "vqa,entailment", "--samples", "24", "--batch-size", "4"]
CALIBRATE += ["--confidence-thresholds", "0.8", "--similarity-thresholds", "", "--encoder-thresholds", ""]
CALIBRATE += ["--risk", "0.5", "--delta", "0.2", "--quiet", "--json"]


def two_processes(argv: list[str]) -> subprocess.CompletedProcess:
    # `--multi_gpu` picks accelerate's torchrun launcher; on a machine without GPUs it runs gloo on the CPU.
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()), "-m", "hf_earlyexit.cli", *argv,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)


def one_process(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [EVAL, CALIBRATE], ids=["eval", "calibrate"])
def test_two_processes_print_one_report_equal_to_one_process(argv, capsys):
    run = two_processes(argv)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1  # only the main process prints
    shared, alone = json.loads(lines[0]), one_process(argv, capsys)
    if argv is EVAL:
        assert shared.pop("seconds") > 0 and alone.pop("seconds") > 0  # the processes' generate time, summed
        assert shared == alone and shared["samples"] == 24
        return
    assert shared["chosen"] == alone["chosen"] == {"exit_policy": "confidence", "exit_threshold": 0.8}
    for task in ("vqa", "entailment"):
        assert shared["tasks"][task]["full_quality"] == alone["tasks"][task]["full_quality"]
        assert shared["tasks"][task]["certificate"] == alone["tasks"][task]["certificate"]


def test_a_timing_refuses_to_share_its_machine():
    run = two_processes(["bench", str(EMBEDDED_MODEL_DIR), "--samples", "2"])
    assert run.returncode != 0 and "bench times one process per device" in run.stderr
