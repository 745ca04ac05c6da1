"""The engines behind the gateway: discovery, the pool's view of each (scraped load, dispatches, ejection) and what an
engine's answer says about it.
"""
