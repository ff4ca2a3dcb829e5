"""Shared test helpers: offline Hub, the ../shared reference files, tiny configs."""

import os
from pathlib import Path

import pytest

for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(variable, "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_EARLYEXIT_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A file or folder under ../shared (or $HF_EARLYEXIT_SHARED); the test is skipped when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: the project's shared/ folder (or $HF_EARLYEXIT_SHARED) is not beside the repo")
    return path


@pytest.fixture
def reference_fixture() -> Path:
    return shared_path("fixtures", "ofa_ref_A")


@pytest.fixture
def bart_tokenizer_dir() -> Path:
    return shared_path("reference", "bart_tokenizer")
