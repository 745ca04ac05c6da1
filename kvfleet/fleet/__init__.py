"""The fleet contract: what the components (engine, gateway, operator) agree on, so none imports another.

metrics (engine metric names, with vLLM's aliases) and load (their reader), redis_keys, headers, priority (the
classes, their engine priority, who may set it), pods (which pods are engine endpoints), errors (OpenAI's error
body), body_limit, http_limits, http_server and openai_schema (the HTTP pieces engine and gateway share),
sizes and engine_settings (the engine's settings, declared once).

May import: the standard library, third-party packages and itself. Never a component (kvfleet.engine,
kvfleet.gateway, kvfleet.operator, kvfleet.kernels) or the composition root: tests/test_import_boundaries.py
checks it.
"""
