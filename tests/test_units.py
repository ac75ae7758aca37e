import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.errors import UsageError
from kvctl.units import (
    DEPRECATED_KEYS,
    format_size,
    gbytes_per_s,
    parse_duration,
    parse_size,
    parse_size_list,
    with_deprecated_keys,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64KiB", 64 * 1024),
        ("64kib", 64 * 1024),
        ("1MiB", 1 << 20),
        ("4M", 4 << 20),
        ("4K", 4096),
        ("2GB", 2_000_000_000),
        ("1.5KiB", 1536),
        (" 8 MiB ", 8 << 20),
        (12, 12),
    ],
)
def test_parse_size_accepts_operator_spellings(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "4XB", "-1", "1.3B", "1e3"])
def test_parse_size_rejects_with_hint(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(text, what="--block-size")
    assert "--block-size" in info.value.cause
    assert info.value.hint


def test_unknown_unit_hint_lists_units() -> None:
    with pytest.raises(UsageError) as info:
        parse_size("4XB")
    assert "KiB" in (info.value.hint or "")


def test_size_list_and_range() -> None:
    assert parse_size_list("4KiB,64KiB") == [4096, 65536]
    assert parse_size_list("4KiB-32KiB") == [4096, 8192, 16384, 32768]
    with pytest.raises(UsageError):
        parse_size_list("4KiB,,8KiB")
    with pytest.raises(UsageError):
        parse_size_list("1MiB-4KiB")


def test_parse_duration() -> None:
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("2m") == 120
    assert parse_duration(3) == 3.0
    with pytest.raises(UsageError):
        parse_duration("soon")
    with pytest.raises(UsageError):
        parse_duration(-1.0)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_format_size_round_trips_within_rounding(n: int) -> None:
    text = format_size(n)
    value = parse_size(text.replace(" ", "")) if text.endswith(" B") else None
    if value is not None:
        assert value == n
    else:
        number, unit = text.split()
        scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
        assert abs(float(number) * scale - n) <= 0.05 * scale + 1e-6  # one decimal


def test_gbps_is_decimal() -> None:
    assert gbytes_per_s(2e9, 1.0) == pytest.approx(2.0)
    assert gbytes_per_s(1, 0) == 0.0


def test_renamed_keys_keep_their_old_name_for_one_release() -> None:
    doc = {"rows": [{"throughput_gbytes_per_s": 1.5, "op": "read"}],
           "nics": [{"rate_gbits_per_s": 200.0, "ports": [{"rate_gbits_per_s": None}]}],
           "verdict": {"expect_gbytes_per_s": 2, "expect_gbps": 3}}
    out = with_deprecated_keys(doc)
    assert out["rows"][0] == {"throughput_gbytes_per_s": 1.5, "throughput_gbps": 1.5,
                              "op": "read"}
    assert out["nics"][0]["rate_gbps"] == 200.0
    assert out["nics"][0]["ports"][0] == {"rate_gbits_per_s": None, "rate_gbps": None}
    assert out["verdict"]["expect_gbps"] == 3  # a mapping's own old key is kept
    assert doc["rows"][0] == {"throughput_gbytes_per_s": 1.5, "op": "read"}  # not modified
    # every renamed key names its unit; every old one was the ambiguous gbps/gbitps
    assert all("gbytes_per_s" in new or "gbits_per_s" in new for new in DEPRECATED_KEYS)
    assert all(old.endswith(("gbps", "gbitps")) for old in DEPRECATED_KEYS.values())
