"""One gateway for several models: which fleet serves a request's `model`, the fleets found in Kubernetes, and the
front that dispatches to each.
"""
