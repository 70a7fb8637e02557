"""Long sequences: tiled compute along the sequence (DeepSpeed's ALST)."""
