"""The one budget parser: bytes, fractions of the baseline peak, percentages, units."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from jaxremat._src.errors import BudgetError
from jaxremat._src.graph import MAX_BYTES

_UNITS = {
  "b": 1,
  "kb": 10**3,
  "mb": 10**6,
  "gb": 10**9,
  "tb": 10**12,
  "kib": 2**10,
  "mib": 2**20,
  "gib": 2**30,
  "tib": 2**40,
}
_QUANTITY = re.compile(
  r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE
)
# No budget is written with more characters than this (2**62 has 19 digits).
_MAX_TEXT_CHARS = 100
# A float up to this is a fraction of the baseline peak; above it, an integral float is bytes.
_MAX_FRACTION = 10.0

BudgetLike = int | float | str


def parse_budget(value: BudgetLike, baseline_peak_bytes: int | None = None) -> int:
  """Turns a budget as users write it into bytes.

  Accepted forms: an int (bytes), a float up to 10 (a fraction of the baseline peak,
  e.g. 0.8), a string ``"80%"``, ``"0.8"``, ``"12GiB"``, ``"500MB"``, ``"1.5e9"``.
  Fractions round up: budget = ceil(fraction x baseline peak), as in the MOCCASIN paper.

  Args:
    value: the budget.
    baseline_peak_bytes: the no-remat peak that fractions refer to.

  Returns:
    The budget in bytes, a positive int.

  Raises:
    BudgetError: for negative, zero, NaN, unknown units, or a fraction without a baseline.

  Example:
    >>> parse_budget("80%", 1000), parse_budget(0.5, 1000), parse_budget("2KiB")
    (800, 500, 2048)
  """
  if isinstance(value, str) and len(value) > _MAX_TEXT_CHARS:
    raise BudgetError(
      f"budget={value[:20]!r}... is {len(value)} characters long, not a budget; write bytes "
      "('1000000'), a fraction ('0.8'), a percentage ('80%') or a size ('12GiB')."
    )
  if isinstance(value, bool):
    raise BudgetError(f"budget={value!r} is a bool; pass bytes (int), a fraction (0.8) or '80%'.")
  if isinstance(value, int):
    return _positive_bytes(value, value)
  if isinstance(value, float):
    return _from_float(value, value, baseline_peak_bytes)
  if not isinstance(value, str):
    raise BudgetError(
      f"budget={value!r} has type {type(value).__name__}; pass bytes (int), a fraction "
      "(0.8), a percentage ('80%') or a size with a unit ('12GiB')."
    )
  m = _QUANTITY.match(value)
  if not m:
    raise BudgetError(
      f"budget={value!r} is not a budget; write bytes ('1000000'), a fraction ('0.8'), "
      "a percentage ('80%') or a size with a unit ('12GiB', '500MB')."
    )
  number, unit = m.group(1), m.group(2).lower()
  if unit == "%":
    return _from_fraction(value, Fraction(number) / 100, baseline_peak_bytes)
  if unit:
    if unit not in _UNITS:
      raise BudgetError(
        f"budget={value!r} has the unknown unit {m.group(2)!r}; use one of "
        "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)."
      )
    return _positive_bytes(value, math.floor(Fraction(number) * _UNITS[unit]))
  if re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):
    return _positive_bytes(value, int(value))
  return _from_float(value, float(number), baseline_peak_bytes)


def _from_float(original, x: float, baseline_peak_bytes: int | None) -> int:
  if not math.isfinite(x):
    raise BudgetError(f"budget={original!r} is not a finite number; pass a positive budget.")
  if x <= _MAX_FRACTION:
    return _from_fraction(original, Fraction(str(x)), baseline_peak_bytes)
  if x == int(x):
    return _positive_bytes(original, int(x))
  raise BudgetError(
    f"budget={original!r} is ambiguous: fractions of the baseline peak are at most "
    f"{_MAX_FRACTION:g} and byte counts are whole; pass an int for bytes or '80%'."
  )


def _from_fraction(original, fraction: Fraction, baseline_peak_bytes: int | None) -> int:
  if fraction <= 0:
    raise BudgetError(f"budget={original!r} is not positive; pass a fraction above 0, e.g. 0.8.")
  if baseline_peak_bytes is None:
    raise BudgetError(
      f"budget={original!r} is relative to the baseline peak, which is not known here; "
      "pass the budget in bytes (e.g. '12GiB')."
    )
  return _positive_bytes(original, math.ceil(fraction * baseline_peak_bytes))


def _positive_bytes(original, n: int) -> int:
  if n <= 0:
    raise BudgetError(f"budget={original!r} is not a positive number of bytes; pass at least 1.")
  if n >= MAX_BYTES:
    raise BudgetError(
      f"budget={original!r} is 2**62 bytes or more, beyond any device and the solvers' "
      "64-bit arithmetic; pass the device's memory (e.g. '80GiB')."
    )
  return n
