"""The file:/// backend's own guarantees, and URL validation for every scheme."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.metadata import MetadataError, known_schemes, open_metadata
from tests.metadata._util import REPO

WRITER = """
import sys
from kvctl.metadata import open_metadata
url, me, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = open_metadata(url)
lease = c.grant_lease(60)
for i in range(rounds):
    value = (me * 2000 + str(i)).encode()
    c.put("kvctl/shared", value)                  # every writer fights over one key
    c.put(f"kvctl/{me}/{i}", value, lease=lease)  # and owns some
    seen = c.get("kvctl/shared")
    if seen is None or not seen.rstrip(b"0123456789") in (b"a" * 2000, b"b" * 2000):
        raise SystemExit(f"torn read: {seen[:40]!r}")
    c.list("kvctl/")
print("ok")
"""


def test_concurrent_processes_never_see_torn_entries(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, me, "40"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me in ("a", "b")]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == "ok"
    with open_metadata(url) as c:
        entries = c.list("kvctl/")
        assert len(entries) == 1 + 2 * 40
        assert entries["kvctl/shared"].rstrip(b"0123456789") in (b"a" * 2000, b"b" * 2000)
    assert not [p for p in (tmp_path / "entries").iterdir() if p.name.startswith(".tmp")]


def test_expired_entries_are_removed_from_disk(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c:
        lease = c.grant_lease(0.2)
        c.put("kvctl/a", b"1", lease=lease)
        c.put("kvctl/b", b"2", lease=lease)
        c.put("kvctl/keep", b"3")
        time.sleep(0.3)
        assert c.list("kvctl/") == {"kvctl/keep": b"3"}
    assert sorted(p.name for p in (tmp_path / "entries").iterdir()) == ["kkvctl%2Fkeep"]
    # A fresh client sweeps lapsed lease files when it grants its first lease.
    with open_metadata(f"file://{tmp_path}") as c:
        fresh = c.grant_lease(5)
    assert [p.name for p in (tmp_path / "leases").iterdir()] == [str(fresh)]


def test_corrupt_file_is_an_error_not_absence(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c:
        c.put("kvctl/a", b"1")
        (tmp_path / "entries" / "kkvctl%2Fa").write_text("{half")
        with pytest.raises(MetadataError) as info:
            c.get("kvctl/a")
        assert "corrupt" in info.value.cause


def test_unusable_directory_is_metadata_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(MetadataError) as info:
        open_metadata(f"file://{blocker}/sub")
    assert str(blocker) in info.value.cause
    assert info.value.hint


def test_too_long_key_is_usage_error(tmp_path: Path) -> None:
    with open_metadata(f"file://{tmp_path}") as c, pytest.raises(UsageError):
        c.put("kvctl/" + "x" * 300, b"v")


@pytest.mark.parametrize("url", [
    "no-scheme-at-all",
    "gopher://host:70",
    "http://:8080",
    "http://127.0.0.1",
    "http://127.0.0.1:0",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:port",
    "http://127.0.0.1:80/some/path",
    "http://[::1",
    "etcd://",
    "etcd://127.0.0.1:2379,:2380",
    "etcd://127.0.0.1:x",
    "etcd://127.0.0.1:2379/prefix",
    "redis://127.0.0.1:6379/notadb",
    "redis://a:6379,b:6379",
    "file://relative/dir",
    "file:///",
])
def test_bad_urls_are_usage_errors_with_a_hint(url: str) -> None:
    with pytest.raises(UsageError) as info:
        open_metadata(url)
    assert info.value.hint
    assert int(info.value.exit_code) == 2


def test_unknown_scheme_lists_every_backend() -> None:
    with pytest.raises(UsageError) as info:
        open_metadata("zk://127.0.0.1:2181")
    assert known_schemes() == ["etcd", "file", "http", "memory", "redis"]
    for scheme in known_schemes():
        assert scheme in (info.value.hint or "")


def test_default_ports_and_credentials_are_accepted() -> None:
    # Opening does not connect; these only have to parse.
    open_metadata("etcd://127.0.0.1").close()
    open_metadata("etcd://127.0.0.1:2379,127.0.0.2:2379").close()
    c = open_metadata("redis://:p%40ss@127.0.0.1/3")
    assert "p%40ss" not in c.url  # the password is not shown
    c.close()
