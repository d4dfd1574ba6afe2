"""Tests of clipscale/losses/: every loss against float64, its errors and options."""
