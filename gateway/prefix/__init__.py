"""What each engine's prefix cache holds of a prompt: the precise index fed by KV events (SSE or vLLM's ZMQ), the
approximate table, and a prompt's worth on each engine.
"""
