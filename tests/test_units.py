import pytest

from mimose_cli.units import format_bytes, parse_size


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
