"""Attention kernels (Triton on GPUs; the CPU decode kernel in numba), each with a plain-torch reference beside it.

May import: the standard library, torch, triton, numba and numpy only; the engine imports these, nothing else does.
"""
