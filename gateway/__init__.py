"""The gateway: KV-aware routing, fleet-wide priority queues, load shedding (issue 4)."""
