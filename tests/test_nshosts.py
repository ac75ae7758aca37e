"""The namespaced-hosts harness itself: hosts are really apart, links shape, cleanup is total."""

from __future__ import annotations

import os
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.fixtures.hosts import MakeHosts, stop
from tests.fixtures.nshosts import REPO, HostNet, HostsUnavailableError, unavailable_reason

SINK = ("import socket\ns = socket.socket(); s.bind(('0.0.0.0', 9000)); s.listen()\n"
        "print('ready', flush=True)\nc, _ = s.accept(); n = 0\n"
        "while (b := c.recv(1 << 20)): n += len(b)\nprint(n)")
SEND = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 9000))\n"
        "block = b'x' * (1 << 20); t = time.monotonic()\n"
        "for _ in range(int(sys.argv[2])): s.sendall(block)\n"
        "s.close(); print(int(sys.argv[2]) * 8 * (1 << 20) / (time.monotonic() - t) / 1e6)")


def _mbit(net_hosts: MakeHosts, shape: float | None, megabytes: int) -> float:
    net = net_hosts(2)
    if shape is not None:
        net[0].shape(rate_mbit=shape)
    sink = net[1].popen(["python3", "-c", SINK])
    assert sink.stdout is not None
    assert sink.stdout.readline() == b"ready\n"
    done = net[0].run(["python3", "-c", SEND, net[1].address, str(megabytes)], timeout=60)
    assert done.returncode == 0, done.stderr
    out, _ = sink.communicate(timeout=30)
    assert out.split()[-1] == str(megabytes << 20).encode()
    return float(done.stdout)


@pytest.mark.integration
def test_hosts_have_their_own_hostname_shm_tmp_and_interfaces(nshosts: MakeHosts) -> None:
    net = nshosts(3)
    (net[0].tmp / "mark").write_text("h1 only")
    for host in net:
        done = host.sh("hostname; echo x > /dev/shm/seen-$(hostname); ls /dev/shm; ls /tmp; "
                       "ls /sys/class/net; ip -4 -o addr show eth0")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.split()
        assert lines[0] == host.name
        assert f"seen-{host.name}" in lines
        assert [f for f in lines if f.startswith("seen-")] == [f"seen-{host.name}"]
        assert ("mark" in lines) == (host.index == 0)
        assert "eth0" in lines
        assert f"{host.address}/24" in lines
    # and they reach each other, but only through their own addresses
    done = net[2].run(["python3", "-c", "import socket; socket.create_connection("
                       f"('{net[0].address}', 1), timeout=2)"])
    assert "ConnectionRefusedError" in done.stderr  # reached h1, nothing listens


@pytest.mark.integration
def test_a_shaped_link_is_slower_in_both_directions(nshosts: MakeHosts) -> None:
    free = _mbit(nshosts, None, 32)
    shaped = _mbit(nshosts, 80, 8)
    assert shaped < 130 < free, (shaped, free)


@pytest.mark.integration
def test_close_kills_every_process_and_removes_every_namespace(nshosts: MakeHosts) -> None:
    net = nshosts(2)
    sleeper = net[1].popen(["sleep", "600"])
    orphan = net[1].sh("setsid sleep 600 > /dev/null 2>&1 & echo $!")
    orphan_pid = int(orphan.stdout)
    names = [h.netns for h in net] + [net.switch]
    net.close()
    net.close()
    assert sleeper.poll() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(orphan_pid):
        time.sleep(0.05)
    assert not _alive(orphan_pid)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=False).stdout
    assert not any(name in listed for name in names)
    assert not net.state.exists()
    stop(sleeper)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _rail_mbit(net: HostNet, rail: int, megabytes: int) -> float:
    """Mbit/s from h1 to h2 over ``rail`` (h1's source address on that rail, checked)."""
    sink = net[1].popen(["python3", "-c", SINK_PEER])
    assert sink.stdout is not None
    assert sink.stdout.readline() == b"ready\n"
    done = net[0].run(["python3", "-c", SEND, net[1].rail_address(rail), str(megabytes)],
                      timeout=60)
    assert done.returncode == 0, done.stderr
    out, _ = sink.communicate(timeout=30)
    peer, count = out.split()[-2:]
    assert count == str(megabytes << 20).encode()
    assert peer.decode() == net[0].rail_address(rail)  # the kernel sent from that rail
    return float(done.stdout)


SINK_PEER = SINK.replace("c, _ = s.accept()", "c, who = s.accept()").replace(
    "print(n)", "print(who[0], n)")


@pytest.mark.integration
def test_two_rails_are_separate_links(tmp_path: Path) -> None:
    try:
        net = HostNet(2, tmp_path, rails=2)
    except HostsUnavailableError as exc:
        pytest.skip(f"no namespaced hosts here: {exc}")
    with net:
        h1, h2 = net
        assert [h1.rail_address(r) for r in (0, 1)] == ["198.18.0.1", "198.18.1.1"]
        done = h2.sh("ip -4 -o addr show eth0; ip -4 -o addr show eth1")
        assert "198.18.0.2/24" in done.stdout, done
        assert "198.18.1.2/24" in done.stdout, done
        h1.shape(rate_mbit=80, rail=1)
        slow = _rail_mbit(net, 1, 8)
        free = _rail_mbit(net, 0, 32)
        assert slow < 130 < free, (slow, free)
        h1.shape(rail=1)  # unshaped again
        assert _rail_mbit(net, 1, 32) > 130
        with pytest.raises(ValueError, match=r"rails 0\.\.1"):
            h1.rail_address(2)


#: Run by an interpreter under /tmp from a checkout under /tmp: one host runs that interpreter
#: in that checkout (its default working directory) and says what it sees.
FROM_TMP = """
import sys
from pathlib import Path
from tests.fixtures.nshosts import HostNet
with HostNet(1, Path(sys.argv[1])) as net:
    probe = ("import os, sys, tests.fixtures.nshosts as m; "
             "print(sys.prefix, m.REPO, os.getcwd(), os.path.exists(sys.argv[1]))")
    done = net[0].run([sys.executable, "-c", probe, sys.argv[2]], timeout=60)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    sys.exit(done.returncode)
"""


@pytest.mark.integration
def test_a_checkout_and_a_venv_under_tmp_stay_visible_inside_hosts(tmp_path: Path) -> None:
    """Cloned into /tmp with its venv there too, hosts still run its interpreter in its
    checkout, and the rest of /tmp stays private (a file beside the checkout is not seen)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced hosts here: {reason}")
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvctl-clone-") as where:
        checkout, venv = Path(where) / "checkout", Path(where) / "venv"
        for part in ("tests/__init__.py", "tests/fixtures/__init__.py",
                     "tests/fixtures/nshosts.py"):
            (checkout / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / part, checkout / part)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                       check=True, timeout=60)
        beside = Path(where) / "beside"
        beside.write_text("not for the hosts")
        done = subprocess.run([str(venv / "bin" / "python"), "-c", FROM_TMP, str(tmp_path),
                               str(beside)], cwd=checkout, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(venv), str(checkout), str(checkout), "False"]


def test_scripts_nshosts_help_names_the_shared_directory_option() -> None:
    done = subprocess.run(["bash", str(REPO / "scripts" / "nshosts"), "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "--shared DIR" in done.stdout
    assert "Example: sudo scripts/nshosts up 3 --shared" in done.stdout


def _lines_until(proc: subprocess.Popen[bytes], last: str, timeout_s: float = 60.0
                 ) -> list[str]:
    """Lines ``proc`` prints up to one starting with ``last`` (bounded by ``timeout_s``)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    fd = proc.stdout.fileno()
    data = b""
    while time.monotonic() < deadline:
        lines = data.decode().splitlines()
        if any(line.startswith(last) for line in lines) and data.endswith(b"\n"):
            return lines
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        data += chunk
    proc.kill()
    _, err = proc.communicate(timeout=10)
    raise AssertionError(f"no {last!r} line in time: {data!r} {err[-2000:]!r}")


@pytest.mark.integration
def test_nshosts_up_prints_commands_that_enter_with_kvctl_on_path_and_the_shared_dir(
        tmp_path: Path) -> None:
    """Issue 30.8: the printed command entered a host where 'kvctl' was not found, and there
    was no option for the shared directory HostNet supports."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespaced hosts here: {reason}")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvctl-dfs-") as dfs:
        shared = Path(dfs) / "tier"  # made by nshosts
        bare = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # no venv: the command must add it
        proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.nshosts", "up", "2",
                                 str(tmp_path / "hosts"), "--shared", str(shared)], cwd=REPO,
                                env=bare, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            lines = _lines_until(proc, "Ctrl-C")
            enter = {line.split()[0]: line.split(": ", 1)[1] for line in lines
                     if line.startswith("h")}
            assert sorted(enter) == ["h1", "h2"], lines
            assert f"every host sees {shared}" in "\n".join(lines)
            script = f"command -v kvctl && hostname && echo hi > {shared}/from-$(hostname)"
            for name, command in enter.items():
                done = subprocess.run([*shlex.split(command), "-c", script], env=bare,
                                      capture_output=True, text=True, timeout=60, check=False)
                assert done.returncode == 0, done.stderr
                assert done.stdout.split() == [str(Path(sys.executable).parent / "kvctl"),
                                               name]
            seen = subprocess.run([*shlex.split(enter["h2"]), "-c", f"cat {shared}/from-h1"],
                                  env=bare, capture_output=True, text=True, timeout=60,
                                  check=False)
            assert seen.stdout == "hi\n", seen.stderr
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        assert proc.returncode == 0
