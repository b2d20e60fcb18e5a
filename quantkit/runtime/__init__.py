"""Packed checkpoints as transformers models (quantkit.load) and the quantized transformers KV cache that
evaluation without the engine uses; generation runs on quantkit.engine."""
