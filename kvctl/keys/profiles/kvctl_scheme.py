"""``kvctl:<hash>``: kvctl's own chain (:mod:`kvctl.keys.chain`) as a profile.

Every seed field is hashed into the first link, with the request's LoRA adapter and
``cache_salt`` taking the place of the configured ones when the prompt names them.
"""

from __future__ import annotations

from kvctl import __version__
from kvctl.keys.chain import HASHES, SeedFields, chain_keys, derive_seed, digest_function
from kvctl.keys.profiles.base import (
    KeyConfig,
    Keyer,
    KeyProfile,
    SeedInfo,
    register_instance,
)
from kvctl.keys.prompts import Prompt


class _KvctlKeyer(Keyer):
    def __init__(self, hash_name: str, config: KeyConfig) -> None:
        self.hash_name = hash_name
        self.config = config
        self._seeds: dict[SeedFields, bytes] = {}
        self.seed = SeedInfo("fields", self._seed(config.fields).hex())

    def _seed(self, fields: SeedFields) -> bytes:
        seed = self._seeds.get(fields)
        if seed is None:
            seed = derive_seed(fields, hash_name=self.hash_name)
            self._seeds[fields] = seed
        return seed

    def fields_for(self, prompt: Prompt) -> SeedFields:
        """The seed fields of ``prompt``: the configured ones, with its LoRA and salt."""
        fields = self.config.fields
        if prompt.lora is not None:
            fields = fields.replace(lora_name=prompt.lora.name, lora_path=prompt.lora.path)
        if prompt.cache_salt is not None:
            fields = fields.replace(cache_salt=prompt.cache_salt)
        if prompt.extra_key is not None:
            extra = dict(fields.extra)
            extra["extra_key"] = prompt.extra_key
            fields = fields.replace(extra=tuple(sorted(extra.items())))
        return fields

    def keys(self, prompt: Prompt) -> list[str]:
        seed = self._seed(self.fields_for(prompt))
        raw = chain_keys(prompt.tokens, block_size=self.config.block_size, seed=seed,
                         hash_name=self.hash_name)
        return [k.hex() for k in raw]


class KvctlProfile(KeyProfile):
    """kvctl's own scheme over one of :data:`~kvctl.keys.chain.HASHES`."""

    engine = "kvctl"
    engine_version = __version__
    default_block_size = 16
    seed_doc = ("H(length-prefixed, domain-separated encoding of model, revision, tenant, "
                "LoRA name/path, KV dtype, KV layout, cache_salt and extra fields)")
    mixes = frozenset({"model", "revision", "tenant", "lora", "cache_salt", "extra_key",
                       "kv_dtype", "kv_layout", "extra"})

    def __init__(self, hash_name: str) -> None:
        self.hash_name = hash_name
        self.name = f"kvctl:{hash_name}"

    def keyer(self, config: KeyConfig) -> Keyer:
        self.validate(config)
        digest_function(self.hash_name)  # fails early when xxhash is missing
        return _KvctlKeyer(self.hash_name, config)


for _hash in HASHES:
    register_instance(KvctlProfile(_hash))
