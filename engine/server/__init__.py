"""The engine's HTTP side: the OpenAI-compatible API (api_server.py), the routes other routers and the gateway ask
for (KV events, LoRA loading, sleep mode, vLLM's and SGLang's worker APIs), request checks, the engine token, and the
process that serves it all (serve.py). It calls the engine core (kvfleet.engine) through AsyncEngine.

May import what kvfleet.engine may (tests/test_import_boundaries.py checks it)."""
