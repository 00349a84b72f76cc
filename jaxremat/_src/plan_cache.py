"""A disk cache of plans, so that a second process reuses a schedule without solving.

An entry is keyed by a fingerprint of everything the compiled step and the plan depend
on (`jaxremat._src.planner` builds it): the traced jaxpr with the contents of its
constants, the graph, the donation, the device, the budget, the solver and its options,
and the versions of jax, jaxlib and jaxremat. Beside the plan chosen for each budget, the
cache keeps every plan the compiler measured for a program (`measured_plans`), so that a
retry at a measured peak finds its plan again. Entries are written atomically; a damaged
or foreign entry is ignored with a warning, and a plan is checked against its graph
before it is used (and verified by the planner before it runs).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

from jaxremat._src.errors import FormatError
from jaxremat._src.graph import RematGraph, read_json, write_json_atomic
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import simulate

PLAN_FORMAT = "jaxremat.plan/1"
MEASURED_FORMAT = "jaxremat.measured-plans/1"
# Measured plans kept per program: the cheapest at each peak, up to this many.
MAX_MEASURED_PLANS = 32


def default_cache_dir() -> pathlib.Path:
  """``$JAXREMAT_CACHE_DIR`` or ``~/.cache/jaxremat``."""
  root = os.environ.get("JAXREMAT_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jaxremat"
  return pathlib.Path(root)


def fingerprint(**parts: Any) -> str:
  """A sha256 over the JSON of ``parts`` (sorted keys): the cache key of a plan."""
  text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


class PlanCache:
  """Plans on disk under ``directory/plans/<key>.json``, measured plans under
  ``directory/measured/<program key>.json``.

  Example:
    >>> import tempfile, jaxremat
    >>> g = jaxremat.RematGraph.build(mem=[4, 2], cost=[1, 1], edges=[(0, 1)])
    >>> cache = PlanCache(tempfile.mkdtemp())
    >>> key = fingerprint(graph=g.to_dict(), budget=6)
    >>> cache.store(key, jaxremat.baseline_schedule(g))
    >>> cache.load(key, g).events
    (('compute', 0), ('compute', 1), ('free', 0))
  """

  def __init__(self, directory: str | os.PathLike | None = None):
    self.directory = pathlib.Path(directory or default_cache_dir()) / "plans"

  def path(self, key: str) -> pathlib.Path:
    return self.directory / f"{key}.json"

  def measured_path(self, program_key: str) -> pathlib.Path:
    """Where the measured plans of a program live: ``directory/measured/<key>.json``."""
    return self.directory.parent / "measured" / f"{program_key}.json"

  def load(self, key: str, graph: RematGraph) -> Schedule | None:
    """The cached plan for ``key``, or None if there is none or it cannot be trusted.

    A damaged file, a file of another format or key, or a plan that is not a valid
    schedule of ``graph`` is ignored with a warning (and will be overwritten).
    """
    path = self.path(key)
    if not path.exists():
      return None
    try:
      entry = read_json(path)
      if not isinstance(entry, Mapping) or entry.get("format") != PLAN_FORMAT:
        raise FormatError(str(path), "format", f"expected {PLAN_FORMAT!r}.")
      if entry.get("key") != key:
        raise FormatError(str(path), "key", "belongs to another plan.")
      schedule = Schedule.from_dict(entry.get("schedule"), source=str(path))
    except FormatError as e:
      warnings.warn(f"Ignoring the damaged plan cache entry {e}", stacklevel=2)
      return None
    check = simulate(graph, schedule)
    if not check.valid:
      warnings.warn(
        f"Ignoring the plan cache entry {path}: it is not a valid schedule of this graph "
        f"({check.error}).",
        stacklevel=2,
      )
      return None
    return schedule

  def store(self, key: str, schedule: Schedule, info: Mapping[str, Any] | None = None) -> None:
    """Writes the plan atomically (an interrupted write leaves no partial file)."""
    self.directory.mkdir(parents=True, exist_ok=True)
    entry = {
      "format": PLAN_FORMAT,
      "key": key,
      "info": dict(info or {}),
      "schedule": schedule.to_dict(),
    }
    write_json_atomic(self.path(key), entry)

  def measured_plans(self, program_key: str, graph: RematGraph) -> list[tuple[Schedule, int]]:
    """Every plan of the program ``program_key`` that the compiler measured, with its
    measured peak in bytes; damaged entries and plans invalid for ``graph`` are skipped."""
    path = self.measured_path(program_key)
    if not path.exists():
      return []
    try:
      entry = read_json(path)
      if not isinstance(entry, Mapping) or entry.get("format") != MEASURED_FORMAT:
        raise FormatError(str(path), "format", f"expected {MEASURED_FORMAT!r}.")
      plans = [
        (Schedule.from_dict(p["schedule"], source=str(path)), int(p["measured_peak_bytes"]))
        for p in entry.get("plans", [])
      ]
    except (FormatError, KeyError, TypeError, ValueError) as e:
      warnings.warn(f"Ignoring the damaged measured-plans entry {path}: {e}", stacklevel=2)
      return []
    return [(s, peak) for s, peak in plans if simulate(graph, s).valid]

  def add_measured(
    self, program_key: str, graph: RematGraph, plans: list[tuple[Schedule, int]]
  ) -> None:
    """Adds measured plans; keeps those no other plan beats in both peak and duration."""
    kept = {s.events: (s, peak) for s, peak in [*self.measured_plans(program_key, graph), *plans]}
    front = []
    for s, peak in sorted(kept.values(), key=lambda p: (p[1], p[0].stats.get("duration", 0))):
      if not front or s.stats.get("duration", 0) < front[-1][0].stats.get("duration", 0):
        front.append((s, peak))
    entry = {
      "format": MEASURED_FORMAT,
      "plans": [
        {"measured_peak_bytes": peak, "schedule": s.to_dict()}
        for s, peak in front[:MAX_MEASURED_PLANS]
      ],
    }
    path = self.measured_path(program_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, entry)
