"""Evaluation: perplexity and model comparisons."""
