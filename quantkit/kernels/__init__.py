"""Kernels: the torch reference (the oracle every fast kernel is tested against) and Triton kernels."""
