"""``store status`` totals are the sums of their parts (issue 30): objects by tier (with the
shared tier's own), DRAM over every node the table lists, and objects unreadable now (every
copy on a suspect node) counted apart from the lost ones."""

from __future__ import annotations

from kvctl.commands.store import status_headline
from kvctl.store import protocol as p
from kvctl.store.master import MasterConfig, MasterCore
from kvctl.store.master.index import ObjectIndex
from kvctl.store.master.records import Node, Obj, Replica
from tests.store.test_liveness import run, states
from tests.store.test_master import Clock, node, put


def test_objects_only_in_the_shared_tier_have_a_tier_of_their_own() -> None:
    """40 objects, 10 of them only in the shared tier: the tiers said dram 30, ssd 0,
    dram+ssd 0 and the 10 were nowhere."""
    index = ObjectIndex()
    host = Node("a", "e1", "seg-a", "127.0.0.1:1", "h", 1 << 20, 0, "off", last_seen=0.0)
    for i in range(30):
        index.install(Obj(f"d{i}", 10, 7, 1, (Replica(host, 16 * i),), shared=i % 2))
    for i in range(10):
        index.install(Obj(f"s{i}", 10, 7, 1, (), shared=1 + i))
    assert index.tiers == {"dram": 30, "ssd": 0, "dram+ssd": 0, "shared": 10}
    assert sum(index.tiers.values()) == len(index)
    only = index.get("s0")
    assert only is not None
    index.set_copies(only, replicas=(Replica(host, 4096),))  # loaded back into DRAM
    assert index.tiers == {"dram": 31, "ssd": 0, "dram+ssd": 0, "shared": 9}


def test_objects_on_a_suspect_node_only_are_unreadable_now_then_lost() -> None:
    """A node SIGKILLed: its own objects were '0 lost' and nowhere else in the status, and
    the header's DRAM left the node out while the table listed it."""
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=1.0, node_grace_s=5.0), clock=clock)
    node(core, "a", 1 << 20)
    node(core, "b", 1 << 20)
    for i in range(20):
        put(core, f"both{i}", 1000, replicas=2)
    on: dict[str, list[str]] = {"a": [], "b": []}
    for i in range(30):
        slot = put(core, f"one{i}", 1000)
        assert isinstance(slot, p.PutSlot)
        on[slot.locations[0].node_id].append(f"one{i}")
    assert on["a"]
    assert core.status().unreadable == 0
    run(core, clock, 2, "b")  # a silent: suspect
    assert states(core) == {"a": "suspect", "b": "alive"}
    st = core.status()
    assert st.unreadable == len(on["a"])
    assert st.lost == 0
    assert sum(st.tiers.values()) == st.objects == 50
    line = status_headline("m:1", st)
    assert "50 objects (tiers dram 50, ssd 0, dram+ssd 0, shared 0)" in line
    assert f"{len(on['a'])} unreadable now" in line
    assert "0 lost" in line
    a = next(n for n in st.nodes if n.node_id == "a")
    b = next(n for n in st.nodes if n.node_id == "b")
    assert st.used_bytes == b.used_bytes  # the master's own total: alive nodes only
    assert "on 1 alive node" in line
    assert "on 1 suspect node (no placements)" in line
    assert a.used_bytes > 0
    run(core, clock, 6, "b")  # past the grace: dropped, its own objects lost
    st = core.status()
    assert st.unreadable == 0
    assert st.lost == len(on["a"])
    assert st.objects == 50 - len(on["a"])
    assert sum(st.tiers.values()) == st.objects


def test_objects_of_a_node_being_removed_are_unreadable_until_lost() -> None:
    """'store node rm' drops a node a slice at a time: between slices its objects left
    that had no other copy were neither unreadable nor lost (the node was out of the table
    the count walked), so 'N objects, 0 unreadable now, 0 lost' hid them."""
    clock = Clock()
    core = MasterCore(MasterConfig(node_timeout_s=1.0, node_grace_s=5.0, slice_objects=4),
                      clock=clock)
    node(core, "a", 1 << 20)
    node(core, "b", 1 << 20)
    on: dict[str, list[str]] = {"a": [], "b": []}
    for i in range(30):
        slot = put(core, f"one{i}", 1000)
        assert isinstance(slot, p.PutSlot)
        on[slot.locations[0].node_id].append(f"one{i}")
    only_a = len(on["a"])
    assert only_a > 8  # more than two slices
    assert core.drop_node("a") is None
    seen = []
    for _ in range(only_a):  # bounded: one slice per tick at most
        st = core.status()
        assert sum(st.tiers.values()) == st.objects
        assert st.unreadable + st.lost == only_a, (st.unreadable, st.lost)
        seen.append((st.unreadable, st.lost))
        if st.unreadable == 0:
            break
        core.tick()
    assert seen[0] == (only_a - 4, 4)  # the first slice went at once
    assert seen[-1] == (0, only_a)
    assert core.status().objects == 30 - only_a


def test_the_json_schema_names_every_status_total() -> None:
    """``unreadable`` was in every ``store status --json`` document but not in its schema:
    a script reading the schema did not know the total the table prints."""
    import json
    from pathlib import Path

    import msgspec

    schema = json.loads((Path(__file__).parents[2] / "docs" / "schemas"
                         / "store.status.schema.json").read_text())
    kvctl_branch = schema["allOf"][1]["then"]
    fields = {f.encode_name for f in msgspec.structs.fields(p.StoreStatus)}
    assert fields <= set(kvctl_branch["properties"]), fields - set(kvctl_branch["properties"])
    assert {"objects", "tiers", "lost", "unreadable"} <= set(kvctl_branch["required"])
