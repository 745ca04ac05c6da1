"""Engine pods: continuous batching over a paged KV cache, behind an OpenAI-compatible HTTP API.

May import: kvfleet.fleet (the fleet contract), kvfleet.kernels (the attention kernels it runs), itself, the
standard library and third-party packages. Never the gateway, the operator or the composition root (kvfleet.cli,
kvfleet.local): tests/test_import_boundaries.py checks it.
"""
