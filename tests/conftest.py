"""Shared test set-up: offline Hub, and fixtures for the ../shared reference files."""

import os
from pathlib import Path

import pytest

for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(variable, "1")

from tests.helpers import shared_path  # noqa: E402  (after the offline switches)


@pytest.fixture
def reference_fixture() -> Path:
    return shared_path("fixtures", "ofa_ref_A")


@pytest.fixture
def bart_tokenizer_dir() -> Path:
    return shared_path("reference", "bart_tokenizer")
