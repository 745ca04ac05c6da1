"""The operator: InferenceFleet reconciler and KV-utilization autoscaler (issue 5)."""
