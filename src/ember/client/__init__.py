"""The client layer: devices, sessions (batching, ids, reads, drops, flush policy) and graph capture."""
