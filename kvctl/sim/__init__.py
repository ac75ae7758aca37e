"""Simulators: what a shared KV pool saves on a multi-turn chat workload (``kvctl sim pool``)."""
