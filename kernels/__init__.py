"""Attention kernels (Triton on GPUs), each with a plain-torch reference beside it.

May import: the standard library, torch and triton only; the engine imports these, nothing else does.
"""
