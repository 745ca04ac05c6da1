"""How kvfleet's CPU kernels are compiled by numba: cached on disk where numba can write, else at every start."""

from __future__ import annotations

import logging

import numba

log = logging.getLogger(__name__)


def compile_kernel(function, **options):
    """numba.njit(function) with fastmath and the GIL released, cached where numba can write (a read-only image
    cannot: the kernel is then compiled at start)."""
    options = {"fastmath": True, "nogil": True, **options}
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError as err:  # no writable place for numba's cache (a read-only image): compile at every start
        log.info("numba cannot cache %s (%s); it compiles at start instead", function.__name__, err)
        return numba.njit(**options)(function)
