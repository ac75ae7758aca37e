"""Segment descriptors in any metadata backend are signed with the token (issue 15.7).

A peer without the token that rewrites ``kvctl/segments/<name>`` in etcd, Redis or a shared
directory must not steer a token-holding initiator anywhere; the real engine puts its entry
back. Each test fails on the old code (unsigned descriptors, no read-back).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from kvctl.metadata import open_metadata
from kvctl.transfer.admin import segment_key
from kvctl.transfer.batch import OpCode, TransferRequest
from kvctl.transfer.engine import TransferEngine
from kvctl.transfer.segments import DescriptorAuthError, SegmentInfo

TOKEN = "desc-" + uuid.uuid4().hex


@pytest.fixture(params=["file", "redis"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'meta'}"
    return str(request.getfixturevalue("redis_url"))


def test_a_rewritten_descriptor_is_refused_and_restored(metadata_url: str) -> None:
    name = f"victim-{uuid.uuid4().hex[:6]}"
    key = segment_key("", name)
    with TransferEngine("desc-t", metadata=metadata_url, token=TOKEN, lease_ttl_s=1.5) as tgt, \
            TransferEngine("desc-i", metadata=metadata_url, token=TOKEN,
                           transport="tcp") as init, open_metadata(metadata_url) as attacker:
        buf = bytearray(4096)
        tgt.register_memory(name, [buf])
        init.register_memory("desc-i.buf", [bytearray(b"y" * 4096)])
        genuine = attacker.get(key)
        assert genuine is not None
        forged = json.loads(genuine)
        forged["addresses"] = ["127.0.0.1:9"]  # the attacker's port
        forged.pop("sig")
        attacker.put(key, json.dumps(forged, sort_keys=True).encode())
        with pytest.raises(DescriptorAuthError):
            init.lookup(name)
        # a forged signature fails as well
        forged["sig"] = "0" * 64
        attacker.put(key, json.dumps(forged, sort_keys=True).encode())
        with pytest.raises(DescriptorAuthError):
            init.open_segment(name)
        deadline = time.monotonic() + 10
        while attacker.get(key) != genuine and time.monotonic() < deadline:
            time.sleep(0.1)
        assert attacker.get(key) == genuine  # the engine put its own entry back
        init.transfer([TransferRequest(OpCode.WRITE, "desc-i.buf", 0, name, 0, 64)])
        assert bytes(buf[:64]) == b"y" * 64


def test_a_descriptor_signed_for_another_key_is_refused() -> None:
    info = SegmentInfo(name="a", kind="shm", engine="e", host="h", pid=1,
                       addresses=("127.0.0.1:1",), seg_id=1, transports=("tcp",), buffers=())
    raw = info.to_json(token=TOKEN, key=segment_key("", "a"))
    assert SegmentInfo.from_json(raw, source=segment_key("", "a"), token=TOKEN) == info
    with pytest.raises(DescriptorAuthError):  # replayed under another name
        SegmentInfo.from_json(raw, source=segment_key("", "b"), token=TOKEN)
    with pytest.raises(DescriptorAuthError):
        SegmentInfo.from_json(raw, source=segment_key("", "a"), token="other")
    # without a token nothing is checked (and old unsigned entries still read)
    assert SegmentInfo.from_json(info.to_json(), source="x") == info
