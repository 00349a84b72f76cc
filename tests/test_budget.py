"""The one budget parser."""

from __future__ import annotations

import math

import pytest

from jaxremat import BudgetError, parse_budget

GOOD = [
  (123456, None, 123456),
  (0.8, 1000, 800),
  (0.9, 146840, 132156),  # MOCCASIN's rl250 budget at 0.9
  (0.8, 146840, 117472),
  (1.0, 1000, 1000),
  (1.25, 1000, 1250),
  ("80%", 1000, 800),
  ("12.5 %", 1000, 125),
  ("0.8", 1000, 800),
  ("1000000", None, 1000000),
  ("12GiB", None, 12 * 2**30),
  ("500MB", None, 500 * 10**6),
  ("1.5kib", None, 1536),
  ("64 B", None, 64),
  ("1.5e9", None, 1500000000),
  (1.5e9, None, 1500000000),
  (1 / 3, 10, 4),  # fractions round up
]


@pytest.mark.parametrize("value,baseline,expected", GOOD)
def test_parses(value, baseline, expected):
  assert parse_budget(value, baseline) == expected


BAD = [
  (-5, "not a positive number of bytes"),
  (0, "not a positive number of bytes"),
  ("-5", "not a positive number of bytes"),
  (-0.5, "not positive"),
  ("0%", "not positive"),
  (math.nan, "not a finite number"),
  ("nan", "is not a budget"),
  (math.inf, "not a finite number"),
  ("12 parsecs", "unknown unit 'parsecs'"),
  ("12XB", "unknown unit 'XB'"),
  ("", "is not a budget"),
  (True, "is a bool"),
  (None, "has type NoneType"),
  (12.5, "is ambiguous"),
  ("0.8", "not known here"),  # a fraction needs a baseline
]


@pytest.mark.parametrize("value,words", BAD)
def test_nonsense_is_a_clear_error(value, words):
  with pytest.raises(BudgetError, match="budget=") as info:
    parse_budget(value, None if value == "0.8" else 1000)
  assert words in str(info.value)
