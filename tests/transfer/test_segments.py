"""Segments: backing stores, bounds checks, descriptors, same-host mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvctl.errors import UnavailableError, UsageError
from kvctl.transfer.errors import BusyError, OutOfRangeError, TransportUnavailableError
from kvctl.transfer.segments import (
    BufferInfo,
    SegmentInfo,
    create_file_segment,
    create_gpu_segment,
    create_shm_segment,
    find_buffer,
    map_remote_buffer,
    parse_location,
    wrap_memory,
)


def test_shm_segment_is_mappable_by_path_and_removed_on_close() -> None:
    seg = create_shm_segment("s1", [4096, 8192])
    infos = seg.buffer_infos()
    assert [(b.offset, b.length) for b in infos] == [(0, 4096), (4096, 8192)]
    path = Path(infos[1].path or "")
    assert path.exists()
    assert path.parent == Path("/dev/shm")
    seg.buffers[1].view[10:15] = b"hello"  # type: ignore[index]
    other = map_remote_buffer(infos[1], segment="s1")  # a peer's view of the same pages
    assert other.view is not None
    assert bytes(other.view[10:15]) == b"hello"
    other.view[0:3] = b"abc"
    assert bytes(seg.buffers[1].view[0:3]) == b"abc"  # type: ignore[index]
    other.close()
    seg.close()
    assert not path.exists()
    seg.close()  # idempotent


def test_file_segment_uses_positional_io(tmp_path: Path) -> None:
    path = tmp_path / "seg.bin"
    seg = create_file_segment("f1", path, [1000, 3000])
    assert path.stat().st_size == 4000
    buf, rel = seg.locate(1500, 100)
    assert (buf.offset, rel) == (1000, 500)
    buf.write_from(rel, memoryview(b"x" * 100))
    assert path.read_bytes()[1500:1600] == b"x" * 100
    out = bytearray(100)
    buf.read_into(rel, memoryview(out))
    assert out == b"x" * 100
    peer = map_remote_buffer(seg.buffer_infos()[1], segment="f1")
    got = bytearray(100)
    peer.read_into(500, memoryview(got))
    assert got == b"x" * 100
    peer.close()
    seg.close()
    assert path.exists()  # a file segment's file belongs to the user


@pytest.mark.parametrize(("offset", "length"), [
    (-1, 10), (0, -1), (12288, 1), (4090, 7), (2**64 - 1, 1), (1, 2**64 - 1),
    (0, 4097), (2**63, 2**63), (4096 + 8192 - 1, 2),
])
def test_out_of_range_is_refused(offset: int, length: int) -> None:
    with pytest.raises(OutOfRangeError):
        find_buffer([0, 4096], [4096, 8192], offset, length, segment="s")


def test_range_inside_one_buffer_only() -> None:
    assert find_buffer([0, 4096], [4096, 8192], 4096, 8192, segment="s") == (1, 0)
    assert find_buffer([0, 4096], [4096, 8192], 4095, 1, segment="s") == (0, 4095)
    with pytest.raises(OutOfRangeError):  # spans the boundary between two buffers
        find_buffer([0, 4096], [4096, 8192], 4095, 2, segment="s")


def test_close_refused_while_in_flight() -> None:
    seg = wrap_memory("m", [bytearray(64)])
    seg.acquire()
    with pytest.raises(BusyError, match="in flight"):
        seg.close()
    seg.release()
    seg.close()


def test_wrap_memory_rejects_read_only_and_empty() -> None:
    with pytest.raises(UsageError, match="read-only"):
        wrap_memory("m", [b"abc"])
    with pytest.raises(UsageError, match="empty"):
        wrap_memory("m", [bytearray()])
    with pytest.raises(UsageError):
        wrap_memory("bad/name", [bytearray(1)])


def test_descriptor_round_trip_and_malformed_entries() -> None:
    info = SegmentInfo("a", "shm", "e", "h/1", 1, ("127.0.0.1:1",), 3, ("shm", "tcp"),
                       (BufferInfo(0, 10, "cpu:0", "/dev/shm/x"),))
    assert SegmentInfo.from_json(info.to_json(), source="k") == info
    assert info.size_bytes == 10
    broken = json.loads(info.to_json())
    del broken["buffers"]
    with pytest.raises(UsageError, match="not a valid segment descriptor"):
        SegmentInfo.from_json(json.dumps(broken).encode(), source="k")
    with pytest.raises(UsageError):
        SegmentInfo.from_json(b"\xff not json", source="k")


def test_unmappable_buffer_is_a_transport_error() -> None:
    with pytest.raises(TransportUnavailableError, match="not mappable"):
        map_remote_buffer(BufferInfo(0, 10, "cpu:0", None), segment="x")
    with pytest.raises(TransportUnavailableError, match="cannot open"):
        map_remote_buffer(BufferInfo(0, 10, "cpu:0", "/dev/shm/kvctl-does-not-exist"),
                          segment="x")


def test_locations_are_validated() -> None:
    assert parse_location("cuda:3") == "cuda:3"
    for bad in ("gpu:0", "cpu", "cuda:x"):
        with pytest.raises(UsageError):
            parse_location(bad)


def test_gpu_segment_unavailable_without_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(UnavailableError, match="torch is not installed"):
            create_gpu_segment("g", 4096)
    else:  # pragma: no cover - only with torch installed
        pytest.skip("torch is installed; see the gpu-marked test")


@pytest.mark.gpu
def test_gpu_segment_round_trip() -> None:  # pragma: no cover - needs CUDA
    torch = pytest.importorskip("torch", reason="GPU segments need torch with CUDA")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    seg = create_gpu_segment("g", 1 << 20)
    buf, rel = seg.locate(4096, 4096)
    buf.write_from(rel, memoryview(b"z" * 4096))
    out = bytearray(4096)
    buf.read_into(rel, memoryview(out))
    assert out == b"z" * 4096
    seg.close()
