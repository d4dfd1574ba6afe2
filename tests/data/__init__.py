"""Tests of clipscale/data/: the digits, shards, pieces and batches, decoders, user data."""
