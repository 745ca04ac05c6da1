"""Envoy as the data plane: its bootstrap, the engines as EDS, the Lua usage filter and feed, its own replies, and the
endpoint picker it calls over ext_proc (with Envoy as a child, beside, or apart).
"""
