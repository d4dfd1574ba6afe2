"""Session setup and fixtures shared by the test modules."""

import os
from pathlib import Path

# Triton decides when it is first imported whether its own @jit library functions
# are interpreted, and torch, timm or open_clip may import it before the kernel
# tests set TRITON_INTERPRET=1; kernels run later would then fail. Import it here,
# before any test module, in interpreter mode (CPU tests never run compiled kernels).
_interpret_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import triton.language  # noqa: E402, F401

if _interpret_before is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _interpret_before

import pytest  # noqa: E402

from clipscale.data.digits import write_digits_shards  # noqa: E402


@pytest.fixture(scope="session")
def digits_root(tmp_path_factory) -> Path:
    """The digits shards, written once per test session."""
    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root, image_size=32)
    return root
