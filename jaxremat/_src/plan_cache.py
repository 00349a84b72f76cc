"""A disk cache of plans, so that a second process reuses a schedule without solving.

An entry is keyed by a fingerprint of everything the plan depends on: the traced jaxpr
and graph, the budget, the solver and its options, the backend and the versions of jax,
jaxlib and jaxremat. Entries are written atomically; a damaged or foreign entry is
ignored with a warning, and a plan is checked against its graph before it is used.
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


def default_cache_dir() -> pathlib.Path:
  """``$JAXREMAT_CACHE_DIR`` or ``~/.cache/jaxremat``."""
  root = os.environ.get("JAXREMAT_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jaxremat"
  return pathlib.Path(root)


def fingerprint(**parts: Any) -> str:
  """A sha256 over the JSON of ``parts`` (sorted keys): the cache key of a plan."""
  text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


class PlanCache:
  """Plans on disk under ``directory/plans/<key>.json``.

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
