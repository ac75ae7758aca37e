"""Prefix-chained KV block keys and engine profiles."""
