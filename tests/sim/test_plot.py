"""``sim pool --plot``: every series stays visible, also where series coincide."""

from pathlib import Path

import pytest

from kvctl.sim.plot import plot_recompute, series_style
from kvctl.sim.replay import CellResult, Floor, Routing

pytest.importorskip("matplotlib")


def _cells(routing: Routing, pool: int, fractions: list[float]) -> list[CellResult]:
    return [CellResult(routing, local, pool, 1000, 0, 0, round(f * 1000), f)
            for local, f in zip((500, 1000, 2000, 4000), fractions, strict=True)]


def _pixels_near(png: Path, hex_color: str, tolerance: float = 0.06) -> int:
    import matplotlib.image

    rgb = tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    image = matplotlib.image.imread(str(png))[..., :3]
    close = (abs(image - rgb) <= tolerance).all(axis=-1)
    return int(close.sum())


def test_series_on_the_floor_all_stay_visible(tmp_path: Path) -> None:
    floor = Floor(100, 100, 44, 0, 244, 1000, 0.244)
    on_floor = [0.244] * 4
    cells = (_cells(Routing.RANDOM, 0, [0.63, 0.6, 0.57, 0.53])
             + _cells(Routing.RANDOM, 400_000, on_floor)
             + _cells(Routing.CACHE_AWARE, 0, [0.6, 0.52, 0.43, 0.3])
             + _cells(Routing.CACHE_AWARE, 400_000, on_floor))
    png = plot_recompute(cells, floor, tmp_path / "pool.png")
    random_pool = series_style("random + shared pool", 1)
    aware_pool = series_style("cache-aware + shared pool", 3)
    # drawn in that order, the later one on top: the earlier must still show around it
    assert random_pool["color"] != aware_pool["color"]
    assert random_pool["markersize"] > aware_pool["markersize"]
    assert random_pool["markerfacecolor"] == "none"
    assert random_pool["linestyle"] != aware_pool["linestyle"]  # interleaved dashes
    assert _pixels_near(png, random_pool["color"]) > 200
    assert _pixels_near(png, aware_pool["color"]) > 200
    # without the pool, the two routings differ in shade and marker from their pooled twins
    assert series_style("random", 0)["color"] != random_pool["color"]
    assert series_style("random", 0)["marker"] == random_pool["marker"] == "o"


def test_a_series_equal_to_another_says_so(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.axes

    seen: list[str] = []
    real_legend = matplotlib.axes.Axes.legend

    def legend(self: matplotlib.axes.Axes, *args: object, **kw: object) -> object:
        seen.extend(self.get_legend_handles_labels()[1])
        return real_legend(self, *args, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    floor = Floor(1, 1, 0, 0, 2, 10, 0.2)
    cells = _cells(Routing.RANDOM, 5, [0.2] * 4) + _cells(Routing.CACHE_AWARE, 5, [0.2] * 4)
    plot_recompute(cells, floor, tmp_path / "same.png")
    assert "cache-aware + shared pool (= random + shared pool)" in seen
    assert "random + shared pool" in seen
