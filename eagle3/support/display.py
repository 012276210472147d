"""How measured numbers and absent values are written for people: reports, run summaries, UI artifacts.

One rule everywhere: a measured float has 3 significant digits (``1.1031390134529149`` -> ``1.10``, ``0.06278`` ->
``0.0628``, ``2958.4`` -> ``2,960``), very small magnitudes switch to an exponent (``7.50e-04``), counts (ints) stay
exact with thousands separators, and a value that was not measured says so in words. Machine-readable files
(report.json, metrics.jsonl, artifact.json) keep the full values; only what people read goes through here.
"""

from __future__ import annotations

import math

NOT_MEASURED = "not measured"
SIGNIFICANT_DIGITS = 3


def sig(value: float | str | None, digits: int = SIGNIFICANT_DIGITS, absent: str = NOT_MEASURED) -> str:
    """``value`` for people: floats to ``digits`` significant digits, ints exact (``7,077``), bools yes/no, None as
    ``absent``, text as it is."""
    if value is None:
        return absent
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    value = float(value)
    if math.isnan(value):
        return absent
    if math.isinf(value):
        return "infinite" if value > 0 else "-infinite"
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = digits - 1 - magnitude
    rounded = round(value, decimals)
    if rounded and math.floor(math.log10(abs(rounded))) > magnitude:  # 0.9996 -> 1.00, not 1.000
        decimals -= 1
        rounded = round(value, decimals)
    return f"{rounded:,.{max(0, decimals)}f}"


def measured(value: float | None, unit: str = "", digits: int = SIGNIFICANT_DIGITS,
             absent: str = NOT_MEASURED) -> str:
    """``sig(value)`` followed by its unit (``1.10 tokens per verifier step``); ``absent`` alone when None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return absent
    text = sig(value, digits)
    return f"{text} {unit}" if unit else text


def signed(value: float | None, unit: str = "", digits: int = SIGNIFICANT_DIGITS) -> str:
    """A difference, with its sign always written (``+0.0738``)."""
    text = measured(value, unit, digits)
    return f"+{text}" if value is not None and value > 0 else text


def percent(fraction: float | None, digits: int = SIGNIFICANT_DIGITS) -> str:
    """A fraction as a percentage (``0.0283`` -> ``2.83%``)."""
    return NOT_MEASURED if fraction is None else f"{sig(100.0 * fraction, digits)}%"


def size(nbytes: int | None) -> str:
    """A byte count for people, decimal units (``29,071,893`` -> ``29.1 MB``)."""
    if nbytes is None:
        return NOT_MEASURED
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{sig(nbytes / scale)} {unit}"
    return f"{nbytes:,} bytes"
