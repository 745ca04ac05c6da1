"""Where saturated requests wait: the fleet-wide queue (Redis, or in-process while Redis is down), its order across
classes and fair share inside one, and the waits it predicts.
"""
