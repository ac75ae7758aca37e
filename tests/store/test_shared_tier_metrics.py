"""The shared tier seen by operators: the master's /metrics (scraped over HTTP) follow
what the tier does, and `kvctl store serve --shared-tier DIR` runs one."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.store import protocol as p
from kvctl.store.client import StoreClient
from kvctl.store.embedded import EmbeddedStore, metrics_url
from kvctl.store.errors import ObjectNotFoundError
from kvctl.store.metrics import SHARED_TIER_NUMBERS, SHARED_TIER_TEXT
from kvctl.store.settings import StoreSettings
from kvctl.store.sharedtier.fileformat import file_bytes, file_name
from tests.fixtures.cli import CliResult
from tests.fixtures.hosts import read_json_doc, stop
from tests.fixtures.schemas import REPO, validate_document
from tests.store.conftest import wait_for

KiB, MiB = 1 << 10, 1 << 20
NS = "kvctl_store_shared_tier"



def _sample(field: str) -> str:
    """The sample a SharedTierStatus number is scraped as."""
    if field == "evictions":
        return 'kvctl_store_evictions_total{tier="shared"}'
    name, kind, _ = SHARED_TIER_NUMBERS[field]
    return f"{NS}_{name}" + ("_total" if kind == "counter" else "")


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value, from a real HTTP scrape of ``url``."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _settings(root: Path, **kw: Any) -> StoreSettings:
    return StoreSettings(listen="127.0.0.1:0", capacity=16 * MiB, metrics_port=0,
                         shared_tier=root, **kw)


def test_every_number_store_status_shows_of_the_tier_is_scraped() -> None:
    """A field added to SharedTierStatus needs its metric (and a row in docs/metrics.md)."""
    fields = set(p.SharedTierStatus.__struct_fields__)
    elsewhere = {"evictions", "errors", "state", *SHARED_TIER_TEXT}
    unmapped = fields - set(SHARED_TIER_NUMBERS) - elsewhere
    assert not unmapped, (f"SharedTierStatus fields {sorted(unmapped)} are not exported: "
                          "add them to SHARED_TIER_NUMBERS in kvctl/store/metrics.py and "
                          "to docs/metrics.md")


def test_no_shared_tier_no_tier_metrics() -> None:
    settings = StoreSettings(listen="127.0.0.1:0", capacity=4 * MiB, metrics_port=0)
    with EmbeddedStore(settings) as store:
        names = scrape(str(metrics_url(store.server)))
    assert not [n for n in names if n.startswith(NS)]
    assert 'kvctl_store_evictions_total{tier="shared"}' not in names
    assert 'kvctl_store_objects{tier="shared"}' not in names


def test_metrics_follow_writes_quota_evictions_and_purges(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    with EmbeddedStore(_settings(root, shared_tier_policy="write-through",
                                 shared_tier_files=2)) as store, \
            StoreClient(store.address) as client:
        url = str(metrics_url(store.server))
        before = scrape(url)
        assert before[f"{NS}_files"] == 0
        assert before[f"{NS}_used_bytes"] == 0
        assert before[f"{NS}_writes_total"] == 0
        assert before[f"{NS}_max_files"] == 2
        assert before[f"{NS}_capacity_bytes"] == 1 << 40
        assert before[f"{NS}_full"] == 0
        for errno_name in ("ENOSPC", "EDQUOT", "ESTALE", "EIO", "other"):
            assert before[f'{NS}_errors_total{{errno="{errno_name}"}}'] == 0

        client.put("a", os.urandom(256 * KiB))  # write-through: its node copies it
        wait_for(lambda: scrape(url)[f"{NS}_files"] == 1, what="the first copy")
        one = scrape(url)
        assert one[f"{NS}_used_bytes"] == file_bytes("a", 256 * KiB)
        assert one[f"{NS}_writes_total"] == 1
        assert (root / file_name("a", client.stat("a").version)).is_file()

        for key in ("b", "c"):  # a third file is past the quota: the oldest copy goes
            client.put(key, os.urandom(256 * KiB))
        wait_for(lambda: scrape(url)[f"{NS}_writes_total"] == 3, what="three copies")
        wait_for(lambda: scrape(url)[f"{NS}_purged_total"] >= 1, what="the evicted file "
                 "deleted")
        after = scrape(url)
        assert after[f"{NS}_files"] == 2
        assert after['kvctl_store_evictions_total{tier="shared"}'] == 1
        assert after[f"{NS}_purge_backlog"] == 0
        assert after[f"{NS}_write_errors_total"] == 0
        assert after[f"{NS}_used_bytes"] == file_bytes("b", 256 * KiB) * 2
        # the scrape and `store status` read the same tables
        st = client.status().shared
        assert st is not None
        for field in (*SHARED_TIER_NUMBERS, "evictions"):
            value, sample = getattr(st, field), _sample(field)
            if field.startswith("fs_") and value < 0:
                assert sample not in after  # statvfs has not run yet: not exported
                continue
            if not field.startswith("fs_"):  # fs_free moves with the disk's other users
                assert after[sample] == value, field


def test_write_through_queue_depth_rises_while_the_file_system_stalls(tmp_path: Path
                                                                      ) -> None:
    with EmbeddedStore(_settings(tmp_path / "dfs", shared_tier_policy="write-through")
                       ) as store, StoreClient(store.address) as client:
        url = str(metrics_url(store.server))
        writer = store.node.shared
        release = threading.Event()
        real_write = writer._write

        def stalled(*args: Any) -> Any:
            release.wait(30)  # a file system that hangs until released
            return real_write(*args)

        writer._write = stalled  # type: ignore[method-assign]
        try:
            for i in range(3):
                client.put(f"q{i}", os.urandom(64 * KiB))
            wait_for(lambda: scrape(url)[f"{NS}_write_through_queued"] == 3,
                     what="three queued copies")
            assert scrape(url)[f"{NS}_write_through_queued_bytes"] == 3 * 64 * KiB
            assert scrape(url)[f"{NS}_files"] == 0
        finally:
            release.set()
        wait_for(lambda: scrape(url)[f"{NS}_write_through_queued"] == 0, what="the queue "
                 "drained")
        done = scrape(url)
        assert done[f"{NS}_write_through_queued_bytes"] == 0
        assert done[f"{NS}_files"] == 3
        assert done[f"{NS}_write_through_skipped_total"] == 0


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_file_system_is_counted_by_errno(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "small", "2m") as small, EmbeddedStore(
            _settings(small / "tier", shared_tier_policy="write-through")) as store, \
            StoreClient(store.address) as client:
        url = str(metrics_url(store.server))
        for i in range(4):  # 4 MiB of copies into 2 MiB
            client.put(f"big{i}", os.urandom(MiB))
        wait_for(lambda: scrape(url)[f'{NS}_errors_total{{errno="ENOSPC"}}'] >= 1,
                 what="an ENOSPC counted")
        full = scrape(url)
        assert full[f"{NS}_full"] == 1
        assert full[f"{NS}_write_errors_total"] >= 1
        assert full[f"{NS}_writes_total"] <= 1
        st = client.status().shared
        assert st is not None
        assert st.state == "full"
        assert full[f'{NS}_errors_total{{errno="ENOSPC"}}'] == st.errors["ENOSPC"]


# ---------------------------------------------------------------- kvctl store serve


def _serve(*args: str, runtime: Path) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvctl", "store", "serve", "--listen", "127.0.0.1:0", *args,
         "--json"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**clean, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(runtime)})


def test_store_serve_shared_tier_writes_through_and_reads_the_file(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    proc = _serve("--capacity", "4MiB", "--shared-tier", str(root), "--shared-tier-policy",
                  "write-through", "--shared-tier-files", "100", "--metrics-port", "0",
                  runtime=tmp_path)
    try:
        card = read_json_doc(proc)
        assert validate_document(card) == "store.serve"
        assert card["shared_tier"] == str(root)
        assert card["shared_tier_policy"] == "write-through"
        keep = os.urandom(MiB)
        with StoreClient(card["master"]) as client:
            client.put("keep", keep)
            wait_for(lambda: client.stat("keep").tier == "dram+shared", what="its copy")
            version = client.stat("keep").version
            path = root / file_name("keep", version)
            assert path.is_file()
            for i in range(6):  # 6 MiB through 4 MiB of DRAM: "keep" (oldest) leaves DRAM
                client.put(f"fill-{i}", os.urandom(MiB))
            wait_for(lambda: client.stat("keep").tier == "shared", what="DRAM copy gone")
            assert client.stat("keep").replicas == []
            # every object gets its write-through copy (the last ones a moment later);
            # until then an evicted object's copy may still land and change the counts
            wait_for(lambda: scrape(card["metrics"])[f"{NS}_files"] == 7, what="7 copies")
            scraped = scrape(card["metrics"])
            only_files = [k for k in ("keep", *(f"fill-{i}" for i in range(6)))
                          if client.stat(k).tier == "shared"]
            assert "keep" in only_files
            assert scraped['kvctl_store_objects{tier="shared"}'] == len(only_files)
            assert scraped[f"{NS}_max_files"] == 100
            assert client.get("keep") == keep  # only the file holds it now
            # and it is the file that answered: damaged, the object is a miss
            with path.open("r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        with StoreClient(card["master"]) as fresh, pytest.raises(ObjectNotFoundError):
            fresh.get("keep")
    finally:
        _, err = stop(proc)
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.parametrize("kind", ["a file", "not creatable"])
def test_store_serve_refuses_a_bad_shared_tier_dir(
        tmp_path: Path, kvctl: Callable[..., CliResult], kind: str) -> None:
    if kind == "a file":
        target = tmp_path / "tier"
        target.write_text("a file")
    else:
        target = Path("/proc/kvctl-no-such-tier")  # even root cannot create it
    r = kvctl("store", "serve", "--listen", "127.0.0.1:0", "--capacity", "4MiB",
              "--shared-tier", str(target), env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert r.exit_code == 2, r.stderr
    assert f"Error: shared tier {'directory ' if kind == 'a file' else ''}{target}" in r.stderr
    assert "\nHint: " in r.stderr
    assert not (tmp_path / "kvctl" / "store.json").exists()  # it never served


def test_store_serve_refuses_a_bad_shared_tier_policy(tmp_path: Path,
                                                      kvctl: Callable[..., CliResult]
                                                      ) -> None:
    r = kvctl("store", "serve", "--listen", "127.0.0.1:0", "--shared-tier",
              str(tmp_path / "t"), "--shared-tier-policy", "sometimes",
              env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert r.exit_code == 2
    assert "Error: unknown shared-tier policy 'sometimes'" in r.stderr
    assert "Hint: use one of write-back, write-through" in r.stderr


def test_store_master_card_names_its_shared_tier(tmp_path: Path) -> None:
    root = tmp_path / "dfs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "store", "master", "--listen", "127.0.0.1:0",
         "--shared-tier", str(root), "--json"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    try:
        card = read_json_doc(proc)
        assert validate_document(card) == "store.master"
        assert card["shared_tier"] == str(root)
        assert card["shared_tier_policy"] == "write-back"
    finally:
        _, err = stop(proc)
    assert proc.returncode == 0, err[-2000:]
