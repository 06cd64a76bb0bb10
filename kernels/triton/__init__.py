"""Triton kernel families behind ``kernels/triton_ops.py`` (one module per family)."""
