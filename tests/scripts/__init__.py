"""Tests of scripts/: benchmarks, the eval script, the open_clip translator, the reproduction scripts."""
