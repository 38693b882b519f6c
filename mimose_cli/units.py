"""Byte sizes as users write them ("6GB", "512MiB") and as we print them."""

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

SIZE_HELP = (
    "A byte size: 6GB and 512MB are decimal (10^9, 10^6 bytes, as GPU vendors print them), "
    "6GiB and 512MiB binary (2^30, 2^20); a bare number is bytes."
)


def parse_size(text, allow_zero: bool = False) -> int:
    """Parse "6GB" (10^9), "6GiB" (2^30), "512MB", "0.5GiB" or an int into bytes."""
    if isinstance(text, bool):
        raise ValueError(f"expected a byte size such as '6GB', got {text!r}")
    if isinstance(text, (int, float)):
        if isinstance(text, float) and not math.isfinite(text):
            raise ValueError(f"a byte size must be a finite number, got {text!r}")
        if text < 0:
            raise ValueError(f"a byte size cannot be negative, got {text!r}")
        if text == 0 and not allow_zero:
            raise ValueError(f"a byte size must be positive, got {text!r}")
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a byte size; write e.g. '6GB', '6GiB', '512MB' or '0.5GiB'"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large to be a byte size")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"a byte size must be positive, got {text!r}")
    return value


def parse_size_option(name: str, value, allow_zero: bool = False) -> int:
    """``parse_size`` of the option ``name`` (``budget``, ``safety_margin``): its ValueError
    names the option and the value as given, e.g. ``safety_margin=-500000: ...``."""
    try:
        return parse_size(value, allow_zero=allow_zero)
    except ValueError as error:
        raise ValueError(f"{name}={value!r}: {error}") from None


def format_bytes(num_bytes) -> str:
    """Human-readable binary size, e.g. 1.50 GiB."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_budget(text, num_bytes) -> str:
    """A budget as the user wrote it, with its binary size beside it when that reads differently:
    "6GB (5.59 GiB)", "6GiB", "unlimited"."""
    if num_bytes is None:
        return "unlimited"
    written = str(text).strip() if text is not None else ""
    match = _SIZE.match(written)
    if not written or (match and match.group(2).lower() in ("kib", "mib", "gib", "tib")):
        return written or format_bytes(num_bytes)  # already binary: nothing to add
    return f"{written} ({format_bytes(num_bytes)})"


def format_duration(ms) -> str:
    """A duration given in milliseconds: "850 ms" under a second, "1.25 s", "2 min 05 s" from a minute on."""
    if ms is None:
        return "-"
    if abs(ms) < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1e3
    if abs(seconds) < 59.995:
        return f"{seconds:.2f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
