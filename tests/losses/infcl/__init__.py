"""Tests of clipscale/losses/infcl/: the Triton kernels, the reference, the ring."""
