"""Fixtures of the data tests, on the CPU and on the GPU."""

import pytest


@pytest.fixture(scope="module")
def jpeg_shards(digits_root, module_tmp) -> list[str]:
    """The digits' training samples as 48-px JPEGs in 3 shards, with damaged samples mixed in
    (tests/helpers/jpeg_shards.py's DAMAGED)."""
    from tests.helpers.jpeg_shards import write_jpeg_shards

    return write_jpeg_shards(digits_root, module_tmp("jpeg_shards"))
