"""``bench transfer --plot``: line-rate reference, invalid baselines, read/write families."""

import dataclasses
import io
import math
from pathlib import Path

import pytest

from kvctl.bench.plot import FAMILIES, INVALID_COLOR, plot_png, plot_rows, series_color
from kvctl.bench.result import ResultRow
from kvctl.errors import UsageError

pytest.importorskip("matplotlib")

BASE = ResultRow(
    engine="kvctl", op="read", transport="tcp", transport_requested="tcp", path="p",
    block_size_bytes=4096, batch_size=8, threads=1, local_location="cpu:0",
    remote_location="cpu:0", batches=10, requests=80, bytes_moved=80 * 4096, elapsed_s=1.0,
    throughput_gbytes_per_s=1.0, throughput_gbits_per_s=8.0, requests_per_s=80.0,
    batch_latency_p50_us=1000.0, batch_latency_p99_us=2000.0, batch_latency_p999_us=3000.0,
    batch_latency_mean_us=1500.0, batch_latency_stddev_us=5.0, request_latency_p50_us=math.nan,
    request_latency_p99_us=math.nan, request_latency_p999_us=math.nan,
    request_latency_stddev_us=math.nan, errors=0, retries=None, line_rate_gbytes_per_s=2.0,
    line_rate_source="tcp-loopback 4 KiB x8, 4 streams", line_rate_fraction=0.5,
    line_rate_valid=True, verified=None)


def _rows(*, invalid: bool) -> list[ResultRow]:
    rows = []
    for op in ("read", "write"):
        for i, size in enumerate((4096, 65536, 1 << 20)):
            gbps = 0.5 + i + (0.2 if op == "write" else 0.0)
            rows.append(dataclasses.replace(
                BASE, op=op, block_size_bytes=size, throughput_gbytes_per_s=gbps,
                line_rate_gbytes_per_s=4.0, line_rate_fraction=gbps / 4.0))
    if invalid:
        rows[-1] = dataclasses.replace(rows[-1], throughput_gbytes_per_s=6.0,
                                       line_rate_fraction=1.5, line_rate_valid=False)
    return rows


def _pixels(png: bytes, hex_color: str, tolerance: float = 0.05) -> int:
    import matplotlib.image

    rgb = tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    image = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    return int((abs(image - rgb) <= tolerance).all(axis=-1).sum())


def test_read_and_write_share_a_family_and_the_line_rate_is_drawn() -> None:
    read, write, line = FAMILIES[0]
    assert (series_color(0, "read"), series_color(0, "write")) == (read, write)
    assert series_color(1, "read") != read  # the next (engine, transport, batch)
    png = plot_png(_rows(invalid=False))
    assert png.startswith(b"\x89PNG")
    for color in (read, write, line):
        assert _pixels(png, color) > 100, color
    assert _pixels(png, INVALID_COLOR) == 0


def test_a_row_above_its_line_rate_is_crossed_out() -> None:
    assert _pixels(plot_png(_rows(invalid=True)), INVALID_COLOR) > 50


def test_latency_axis_is_in_the_tables_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.axes

    labels: list[str] = []
    data: list[list[float]] = []
    real_label, real_plot = matplotlib.axes.Axes.set_ylabel, matplotlib.axes.Axes.plot

    def set_ylabel(self: matplotlib.axes.Axes, text: str, *a: object, **kw: object) -> object:
        labels.append(text)
        return real_label(self, text, *a, **kw)

    def plot(self: matplotlib.axes.Axes, xs: list[float], ys: list[float], *a: object,
             **kw: object) -> object:
        data.append(list(ys))
        return real_plot(self, xs, ys, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", set_ylabel)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    plot_png(_rows(invalid=False))
    assert "p99 batch latency (ms)" in labels
    assert [2.0, 2.0, 2.0] in data  # 2000 us drawn as 2 ms, the table's batch latency unit


def test_plot_rows_writes_the_file_or_says_why_not(tmp_path: Path) -> None:
    out = plot_rows(_rows(invalid=False), tmp_path / "bench.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(UsageError, match="cannot write plot"):
        plot_rows(_rows(invalid=False), tmp_path / "missing" / "bench.png")
    with pytest.raises(UsageError, match="nothing to plot"):
        plot_png([])
