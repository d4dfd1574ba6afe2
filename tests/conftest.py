"""Fixtures shared by the test modules."""

from pathlib import Path

import pytest

from clipscale.data.digits import write_digits_shards


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """The digits shards, written once per test session."""
    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root, image_size=32)
    return root
