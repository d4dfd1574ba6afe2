"""clipscale: CLIP-style contrastive training at batch sizes other frameworks cannot reach."""

__version__ = "0.1.0"
