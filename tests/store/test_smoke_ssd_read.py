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
