"""Cache building blocks shared by the KV store and the simulators (LRU eviction order)."""

from kvctl.cache.lru import LruCache, LruIndex

__all__ = ["LruCache", "LruIndex"]
