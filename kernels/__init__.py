"""Attention kernels (Triton on GPUs; the CPU decode kernel in numba), each with a plain-torch reference beside it, and
the CPU layers' fused elementwise kernels (numba; the torch operators they replace are their reference).

May import: the standard library, torch, triton, numba and numpy only; the engine imports these, nothing else does.
"""
