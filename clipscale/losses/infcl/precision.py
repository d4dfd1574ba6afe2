"""Float32 products that follow PyTorch's setting: TF32 only where the user allowed it.

PyTorch's float32 CUDA matmuls use IEEE float32 unless the user allows TF32
(`torch.backends.cuda.matmul.allow_tf32 = True`,
`torch.set_float32_matmul_precision("high")` or, from torch 2.9,
`torch.backends.cuda.matmul.fp32_precision = "tf32"`). Inf-CL reads the same
setting, and its `exact=True` forces IEEE float32 whatever it says.
"""

from __future__ import annotations

import contextlib

import torch


def torch_allows_tf32() -> bool:
    """Whether PyTorch's own float32 CUDA matmuls may use TF32, as the user set it."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")  # reflects every API once one is set
    return precision == "tf32" if precision != "none" else bool(matmul.allow_tf32)


@contextlib.contextmanager
def tf32_allowed(allowed: bool):
    """PyTorch's float32 matmuls with TF32 allowed or not inside, the user's setting
    restored after.

    The switch is flipped through the API the user set it with: torch refuses to
    read a state that mixes the legacy one (allow_tf32) and the new one (fp32_precision).
    """
    matmul = torch.backends.cuda.matmul
    try:
        key, saved, value = "allow_tf32", matmul.allow_tf32, allowed
    except RuntimeError:  # set through fp32_precision
        key, saved, value = "fp32_precision", matmul.fp32_precision, "tf32" if allowed else "ieee"
    setattr(matmul, key, value)
    try:
        yield
    finally:
        setattr(matmul, key, saved)
