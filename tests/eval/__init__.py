"""Tests of clipscale/eval/: tasks and their data, metrics, evaluation in and after training."""
