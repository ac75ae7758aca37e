"""``kvctl store top``: a live view of a store, from its status and its metrics endpoint.

Layers, lower first (a lower one never imports an upper one):

- :mod:`kvctl.top.scrape`: read a Prometheus endpoint into a :class:`~kvctl.top.scrape.Scrape`;
  rates and quantiles between two scrapes.
- :mod:`kvctl.top.view`: what is shown (:class:`~kvctl.top.view.TopView`: nodes, tiers,
  hit/miss/eviction rates, ops/s and p99 per operation, recent errors), as data and JSON.
- :mod:`kvctl.top.sources`: where it comes from: a kvctl master (status over the store
  protocol, rates from its ``--metrics-port`` endpoint) or a ``mooncake_master`` (its HTTP
  ``/health``, ``/get_segments_detail`` and ``/metrics``).
The terminal side (Rich renderables and the live loop, ``q`` or Ctrl-C quits) lives with
the command, in :mod:`kvctl.commands._top_screen`: the library never imports Rich.
"""
