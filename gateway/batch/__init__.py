"""The OpenAI Batch API on the gateway: files, batches, and their runner in the capacity interactive traffic leaves."""
