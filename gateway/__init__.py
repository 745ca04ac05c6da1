"""The gateway: authenticates, limits, routes each request where it starts soonest, queues fleet-wide by priority
in Redis when the fleet is saturated, sheds with 429/503, and relays the engine's answer.

May import: kvfleet.fleet (the fleet contract), itself, the standard library and third-party packages. Never the
engine, the kernels, the operator or the composition root: tests/test_import_boundaries.py checks it.
"""
