"""The decode role: KV intake, the request table, the batch step, admission pressure."""
