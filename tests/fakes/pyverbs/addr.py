"""``pyverbs.addr``: GID, GlobalRoute and AHAttr with pyverbs' fields and defaults."""

from __future__ import annotations

from tests.fakes.pyverbs.pyverbs_error import PyverbsUserError


def _parse(val: str) -> bytes:
    words = val.split(":")
    if len(words) != 8 or not all(len(w) == 4 for w in words):
        raise PyverbsUserError(f"Invalid GID {val!r}")
    try:
        return bytes.fromhex("".join(words))
    except ValueError:
        raise PyverbsUserError(f"Invalid GID {val!r}") from None


class GID:
    """``union ibv_gid``; ``str()`` and ``.gid`` give eight 4-digit words."""

    def __init__(self, val: str | None = None) -> None:
        self.raw = _parse(val) if val is not None else bytes(16)

    @property
    def gid(self) -> str:
        h = self.raw.hex()
        return ":".join(h[i : i + 4] for i in range(0, 32, 4))

    def __str__(self) -> str:
        return self.gid


class GlobalRoute:
    """``struct ibv_global_route`` (hop limit 1 unless set, as in pyverbs)."""

    def __init__(self, dgid: GID | None = None, flow_label: int = 0, sgid_index: int = 0,
                 hop_limit: int = 1, traffic_class: int = 0) -> None:
        self.dgid = dgid if dgid is not None else GID()
        self.flow_label = flow_label
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class


class AHAttr:
    """``struct ibv_ah_attr``; the GRH fields are flattened as pyverbs exposes them."""

    def __init__(self, dlid: int = 0, sl: int = 0, src_path_bits: int = 0, static_rate: int = 0,
                 is_global: int = 0, port_num: int = 1, gr: GlobalRoute | None = None) -> None:
        self.dlid = dlid
        self.sl = sl
        self.src_path_bits = src_path_bits
        self.static_rate = static_rate
        self.is_global = is_global
        self.port_num = port_num
        gr = gr if gr is not None else GlobalRoute()
        self.dgid = gr.dgid
        self.flow_label = gr.flow_label
        self.sgid_index = gr.sgid_index
        self.hop_limit = gr.hop_limit
        self.traffic_class = gr.traffic_class
