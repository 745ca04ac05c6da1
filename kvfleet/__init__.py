"""kvfleet: LLM serving on Kubernetes with batching at two levels."""

__version__ = "0.1.0"
