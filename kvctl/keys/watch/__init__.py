"""``kvctl verify-keys watch``: live KV events of engine instances, checked as they come.

- :mod:`.wire`: the frames vLLM and SGLang publish (ZeroMQ multipart ``topic, seq,
  payload``; msgpack ``[ts, events, rank]`` with tagged event maps), decoded without a crash
  on anything a peer may send;
- :mod:`.hashing`: recompute a ``BlockStored``'s hashes with a key profile;
- :mod:`.checker`: the state of every instance (chains, blocks held, sequence numbers) and
  the findings: mismatches with their likely cause, divergence across instances, what a
  shared pool would have saved;
- :mod:`.source`: the ZeroMQ subscription, replay of sequence gaps, dead endpoints;
- :mod:`.record`: the ``--record`` file, read back by ``kvctl sim trace --format kv-events``;
- :mod:`.session`: one bounded run tying them together.
"""
