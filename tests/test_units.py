import pytest

from mimose_cli.units import format_budget, format_bytes, format_duration, parse_size


@pytest.mark.parametrize("text, expected", [
    ("6GB", 6 * 10**9), ("6GiB", 6 * 2**30), ("512MB", 512 * 10**6),
    ("0.5GiB", 2**29), ("512MiB", 512 * 2**20), ("1024", 1024), (4096, 4096), ("2 gb", 2 * 10**9),
])
def test_parse_size_decimal_and_binary(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["six GB", "6XB", "", "-1GB", "0", True])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(None) == "-"


@pytest.mark.parametrize("text,expected", [
    ("6GB", "6GB (5.59 GiB)"), ("6GiB", "6GiB"), ("512MiB", "512MiB"), ("40000000", "40000000 (38.15 MiB)"),
    (None, "unlimited")])
def test_a_budget_is_shown_as_written_with_its_binary_size_beside(text, expected):
    assert format_budget(text, parse_size(text) if text else None) == expected


@pytest.mark.parametrize("ms,expected", [
    (850.2, "850 ms"), (999.4, "999 ms"), (1000, "1.00 s"), (1234, "1.23 s"), (59999, "1 min 00 s"),
    (125_000, "2 min 05 s"), (7_300_000, "2 h 01 min"), (None, "-")])
def test_durations_over_a_second_are_in_seconds(ms, expected):
    assert format_duration(ms) == expected


@pytest.mark.parametrize("size, allow_zero", [(-1, False), (-0.5, True), (-500_000, True)])
def test_parse_size_refuses_a_negative_number_even_where_zero_is_allowed(size, allow_zero):
    with pytest.raises(ValueError, match="negative"):
        parse_size(size, allow_zero=allow_zero)
