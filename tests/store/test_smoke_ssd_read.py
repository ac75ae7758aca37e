"""``store smoke``'s ``ssd-read`` reads from the SSD tier or does not pass (issue 30): it
passed with "not evicted from DRAM, so SSD read not forced" when the eviction check before
it left the probe in DRAM."""

from __future__ import annotations

from kvctl.store.client import StoreClient
from kvctl.store.smoke import _EmbeddedCluster, _Run, _ssd_prepare, _ssd_verify, _SsdProbe


def test_ssd_read_evicts_the_probe_itself_and_reads_it_from_ssd() -> None:
    """No eviction check ran before (the probe is still in DRAM): the check pushes it out
    and the read loads it from SSD; the probe ends back in DRAM."""
    cluster = _EmbeddedCluster()
    try:
        with StoreClient(cluster.address) as client:
            run = _Run(client, new_client=lambda: StoreClient(cluster.address),
                       prefix="ssd-read-test/", progress=None)
            probe = _SsdProbe()
            run.check("ssd-persist", lambda: _ssd_prepare(run, client, probe))
            assert "dram" in client.stat(probe.key).tier.split("+")
            run.check("ssd-read", lambda: _ssd_verify(run, client, probe))
            client.batch_remove(sorted(run.keys))
    finally:
        cluster.close()
    persist, read = run.checks
    assert persist.status == "pass", persist
    assert read.status == "pass", read
    assert read.detail.startswith("evicted from DRAM (ssd"), read.detail
    assert "loaded from SSD and read back byte for byte" in read.detail
    assert "not forced" not in read.detail


def test_ssd_read_on_a_store_too_large_skips_before_writing() -> None:
    """A 1 GiB store cannot be pushed out of DRAM within the 256 MiB budget: the check
    wrote the whole budget (256 x 1 MiB, leaving it to evict other objects of a store in
    use) before saying skip; the eviction check beside it skips before writing anything."""
    from types import SimpleNamespace
    from typing import Any

    from kvctl.store.smoke import MiB

    class Big:
        puts = 0

        def stat(self, key: str) -> Any:
            return SimpleNamespace(tier="dram+ssd")

        def status(self) -> Any:
            return SimpleNamespace(capacity_bytes=1024 * MiB)

        def batch_put(self, items: list[tuple[str, bytes]]) -> list[None]:
            self.puts += len(items)
            return [None] * len(items)

    big = Big()
    run = _Run(big, new_client=lambda: big, prefix="big/", progress=None)  # type: ignore[arg-type]
    probe = _SsdProbe()
    probe.key, probe.value = "big/ssd-0", b"x"
    run.check("ssd-read", lambda: _ssd_verify(run, big, probe))  # type: ignore[arg-type]
    (read,) = run.checks
    assert read.status == "skip", read
    assert "256 MiB budget" in read.detail, read.detail
    assert big.puts == 0
