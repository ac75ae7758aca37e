"""``kvctl doctor env --shared-tier DIR``: rename atomicity, probes from other hosts,
space, mount type (fake mountinfo)."""

from __future__ import annotations

from pathlib import Path

from kvctl.doctor.env import Status, default_checks, run_checks
from kvctl.store.checksum import checksum
from kvctl.store.sharedtier import doctor
from kvctl.store.sharedtier.fileformat import write_object

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/3fs rw,relatime shared:20 - fuse.hf3fs hf3fs rw,user_id=0
41 22 0:51 / /mnt/nfs rw,relatime shared:21 - nfs4 srv:/export rw,vers=4.2,nocto
"""


def test_mount_types(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    dist = doctor.check_mount(Path("/mnt/3fs/kvctl"), info)
    assert dist.status is Status.OK
    assert "fuse.hf3fs at /mnt/3fs" in dist.detail
    nocto = doctor.check_mount(Path("/mnt/nfs/kv"), info)
    assert nocto.status is Status.ERROR
    assert nocto.hint is not None
    assert "close-to-open" in nocto.hint
    local = doctor.check_mount(Path("/var/tmp/x"), info)
    assert local.status is Status.OK
    assert "this host only" in local.detail
    assert local.hint


def test_rename_space_and_probes_of_other_hosts(tmp_path: Path) -> None:
    assert doctor.check_rename(tmp_path, rounds=50).status is Status.OK
    assert not list(tmp_path.iterdir())  # nothing left behind
    space = doctor.check_space(tmp_path)
    assert space.status in (Status.OK, Status.ERROR)
    assert "GiB free" in space.detail
    first = doctor.check_visibility(tmp_path)
    assert first.status is Status.OK
    assert "no other host" in first.detail
    probes = tmp_path / doctor.PROBE_DIR
    mine = next(probes.glob("*.probe"))
    (probes / "other-host.probe").write_bytes(mine.read_bytes())  # as another host left it
    seen = doctor.check_visibility(tmp_path)
    assert seen.status is Status.OK
    assert "other-host" in seen.detail
    (probes / "torn-host.probe").write_bytes(mine.read_bytes()[:-5])
    torn = doctor.check_visibility(tmp_path)
    assert torn.status is Status.ERROR
    assert "torn-host" in torn.detail


def test_doctor_env_runs_them_all(tmp_path: Path) -> None:
    data = b"x" * 100  # an object file next to the probes is left alone
    write_object(tmp_path / "ab" / "f.kvs", "k", 1, memoryview(data), checksum(data), "0" * 16)
    names = [c.name for c in run_checks(default_checks([], [tmp_path]))]
    assert {"shared-tier-mount", "shared-tier-space", "shared-tier-rename",
            "shared-tier-visibility"} <= set(names)
    assert (tmp_path / "ab" / "f.kvs").exists()
    missing = run_checks(default_checks([], [tmp_path / "nope"]))
    assert [c.status for c in missing if c.name == "shared-tier"] == [Status.ERROR]


def test_a_missing_directory_says_the_exit_status_is_0_and_require_makes_it_fatal(
        kvctl, tmp_path: Path) -> None:
    # issue 30.6: the error row exited 0 without saying so (documented: doctor env reports,
    # --require judges); the row itself now says it, and --require shared-tier works both ways
    missing = tmp_path / "nope"
    shown = kvctl("doctor", "env", "--shared-tier", str(missing), "--json")
    assert shown.exit_code == 0
    row = next(c for c in shown.json()["components"] if c["name"] == "shared-tier")
    assert row["status"] == "error"
    assert f"{missing} is not a directory" in row["detail"]
    assert "exit status stays 0" in row["detail"]
    assert "--require shared-tier makes this fatal (exit 3)" in row["detail"]
    required = kvctl("doctor", "env", "--shared-tier", str(missing), "--require", "shared-tier")
    assert required.exit_code == 3
    assert "required component shared-tier is failing" in required.stderr
    present = kvctl("doctor", "env", "--shared-tier", str(tmp_path), "--require", "shared-tier",
                    "--json")
    assert present.exit_code == 0, present.stderr
    first = next(c for c in present.json()["components"] if c["name"] == "shared-tier")
    assert (first["status"], first["detail"]) == (
        "ok", f"{tmp_path}: a directory; no other host's probe here yet, so not known to be "
        "shared")


def test_a_local_type_with_other_hosts_probes_is_shared_not_this_host_only(
        tmp_path: Path) -> None:
    # issue 30.6: 'a local file system, seen by this host only' beside 'read and verified the
    # probes of h2, h3, h4' in the same run; the probes overrule the type's name
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    alone = doctor.check_mount(Path("/var/tmp/x"), info)
    assert "by its type (the only sign read, from " in alone.detail
    shared = doctor.check_mount(Path("/var/tmp/x"), info, shared_with=["h2", "h3"])
    assert shared.status is Status.OK
    assert "this host only" not in shared.detail
    assert "yet shared: the probes of h2, h3 were read here" in shared.detail
    unknown = MOUNTINFO + "42 22 0:52 / /mnt/odd rw - oddfs odd rw\n"
    info.write_text(unknown)
    assert "shared with h2" in doctor.check_mount(Path("/mnt/odd/t"), info,
                                                   shared_with=["h2"]).detail
