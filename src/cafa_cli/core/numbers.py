"""The bounds every number a user writes is read within, and the reading of a whole number
from text; torch-free, for the settings' checks (jobs/config) and the method options alike.

A value outside these is a slip, not a setting: every default and published value lies within
1e-4 to 2,000 (EATA's Fisher weight), while a temperature, σ or stream rate of 1e-300 divides
to infinity and a weight of 1e300 overflows float32."""

from __future__ import annotations

LEAST_POSITIVE, MOST_NUMBER = 1e-6, 1e6
# Past 20 digits a whole number is beyond every bound (2**64 has 20), and Python refuses to read
# one of more than 4,300 at all (ValueError): text that long is refused before int() sees it.
MOST_DIGITS = 20


def sane(value: float, most: float = MOST_NUMBER, zero: bool = False) -> bool:
    """Whether `value` is a number a user means: from LEAST_POSITIVE to `most`, or 0 itself where
    0 is a setting of its own (`zero`). A NaN is none; so is 1e-310, which float32 reads as 0."""
    return (zero and value == 0) or LEAST_POSITIVE <= value <= most


def read_whole(text: str, signed: bool = True) -> int | None:
    """The whole number `text` writes in ASCII digits ('12', ' 12 ', with `signed` '+12' or
    '-3'), else None: '1.0', '1e3', '²' (isdigit() passes it, int() does not), '١٢' (int()
    reads it) and more than MOST_DIGITS digits are none."""
    digits = text.strip()
    if signed:
        digits = digits.removeprefix("+") if digits.startswith("+") else digits.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > MOST_DIGITS:
        return None
    return int(text.strip())
