"""Snapshots: exactly what topo reads, replayed identically, and safe to extract."""

import io
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.errors import UsageError
from kvctl.probe.host import scan_sysfs
from kvctl.probe.nvml import NvmlGpu, NvmlReport, RecordedNvml
from kvctl.probe.sysfs import SysfsReader, SysfsRecorder
from kvctl.probe.types import Unavailable
from kvctl.probe.verbs import RecordedVerbs
from kvctl.topo.build import discover
from kvctl.topo.export import topology_payload
from kvctl.topo.snapshot import open_snapshot, write_snapshot
from tests.fixtures.sysfs import HostSpec, a100_host, h100_host

Tree = Callable[[HostSpec], Path]


def _no_live() -> tuple[RecordedNvml, RecordedVerbs]:
    return (RecordedNvml(Unavailable("nvml", "none")), RecordedVerbs(Unavailable("verbs", "none")))


def test_round_trip_replays_the_same_topology(sysfs_tree: Tree, tmp_path: Path) -> None:
    root = sysfs_tree(a100_host())
    facts = scan_sysfs(SysfsReader(root))
    nvml = RecordedNvml(NvmlReport("550.1", tuple(
        NvmlGpu(i, pci, name="A100 from NVML") for i, pci in enumerate(facts.gpus))))
    verbs = RecordedVerbs(Unavailable("verbs", "none"))
    out = tmp_path / "snap.tar.gz"
    write_snapshot(out, root, nvml, verbs)
    direct = topology_payload(discover(SysfsReader(root), nvml, verbs))
    with open_snapshot(out) as snap:
        replayed = topology_payload(discover(snap.reader, snap.nvml, snap.verbs))
        extracted = snap.root
    assert not extracted.exists()
    direct.pop("sources")
    replayed.pop("sources")
    assert replayed == direct
    assert replayed["gpus"][0]["model"] == "A100 from NVML"


def test_archive_holds_exactly_what_was_read(sysfs_tree: Tree, tmp_path: Path) -> None:
    root = sysfs_tree(h100_host(absolute_links=True))
    (root / "sys/kernel/mm").mkdir(parents=True)
    (root / "sys/kernel/mm/unrelated").write_text("x\n")
    rec = SysfsRecorder()
    scan_sysfs(SysfsReader(root, recorder=rec))
    out = tmp_path / "snap.tar.gz"
    summary = write_snapshot(out, root, *_no_live())
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    files = {n for n, m in members.items() if m.isfile()} - {"kvctl-snapshot.json"}
    links = {n: m.linkname for n, m in members.items() if m.issym()}
    assert files == {p.lstrip("/") for p in rec.files}
    assert set(links) == {p.lstrip("/") for p in rec.links}
    assert not any(t.startswith("/") for t in links.values())  # absolute links rewritten
    assert "sys/kernel/mm/unrelated" not in members
    assert (summary.files, summary.links) == (len(rec.files), len(rec.links))


def _tar(path: Path, add: Callable[[tarfile.TarFile], None]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        meta = b'{"format": "kvctl-topo-snapshot", "version": 1, "nvml": {"unavailable": ' \
               b'{"source": "nvml", "reason": "x", "hint": null}}, "verbs": {"unavailable": ' \
               b'{"source": "verbs", "reason": "x", "hint": null}}}'
        info = tarfile.TarInfo("kvctl-snapshot.json")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        add(tar)
    return path


def _file(name: str) -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    return add


def _link(name: str, target: str) -> Callable[[tarfile.TarFile], None]:
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = tarfile.SYMTYPE
        info.linkname = target
        tar.addfile(info)
    return add


def _device(tar: tarfile.TarFile) -> None:
    info = tarfile.TarInfo("sys/devices/evil")
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    tar.addfile(info)


@pytest.mark.parametrize(("add", "match"), [
    (_file("../evil"), "unexpected member"),
    (_file("/tmp/evil"), "unexpected member"),
    (_file("sys/../../evil"), "unexpected member"),
    (_file("etc/passwd"), "unexpected member"),
    (_link("sys/class/x", "/etc/passwd"), "outside"),
    (_link("sys/class/x", "../../../../etc/passwd"), "outside"),
    (_device, "not a file"),
])
def test_hostile_archives_are_refused(
    tmp_path: Path, add: Callable[[tarfile.TarFile], None], match: str
) -> None:
    path = _tar(tmp_path / "bad.tar.gz", add)
    with pytest.raises(UsageError, match=match):
        open_snapshot(path)
    assert not (tmp_path / "evil").exists()


def test_damaged_archives_are_usage_errors(tmp_path: Path, sysfs_tree: Tree) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tarball at all")
    with pytest.raises(UsageError, match="not a readable"):
        open_snapshot(junk)
    good = tmp_path / "good.tar.gz"
    write_snapshot(good, sysfs_tree(h100_host()), *_no_live())
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UsageError, match="not a readable"):
        open_snapshot(cut)
    with pytest.raises(UsageError, match="does not exist"):
        open_snapshot(tmp_path / "missing.tar.gz")
    no_meta = tmp_path / "nometa.tar.gz"
    with tarfile.open(no_meta, "w:gz") as tar:
        _file("sys/x")(tar)
    with pytest.raises(UsageError, match=r"no kvctl-snapshot\.json"):
        open_snapshot(no_meta)
