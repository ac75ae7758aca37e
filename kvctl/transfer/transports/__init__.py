"""Transports: ``shm`` (same host, one-sided), ``tcp`` (framed, sliced), ``rdma`` (pyverbs)."""
