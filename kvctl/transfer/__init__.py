"""Embedded transfer engine: segments, metadata service, batched READ/WRITE transports."""
