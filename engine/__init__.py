"""Engine pods: continuous batching over a paged KV cache."""
