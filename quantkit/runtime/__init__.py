"""Packed checkpoints as transformers models (quantkit.load: `eval ppl --reference`, calibration); generation
and quantized KV caches are quantkit.engine's."""
