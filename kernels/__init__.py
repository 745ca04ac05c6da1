"""Attention kernels (Triton on GPUs), each with a plain-torch reference beside it."""
