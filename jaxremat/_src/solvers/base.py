"""The interface every solver implements, and the registry that names them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Progress:
  """One progress report of a running solve.

  Attributes:
    elapsed_s: wall seconds since the solver started.
    best_duration: duration of the best schedule within budget so far (None: none yet).
    lower_bound: a proven lower bound on the duration, if the solver has one.
    message: a short free-form note (phase, solver name).
  """

  elapsed_s: float
  best_duration: float | None
  lower_bound: float | None = None
  message: str = ""


ProgressCallback = Callable[[Progress], None]


class Solver(Protocol):
  """``solver(graph, budget_bytes, *, time_limit_s, workers, progress, **options)``.

  Returns a `Schedule` whose peak is within ``budget_bytes`` and whose ``stats`` hold
  at least ``status`` ("optimal" or "feasible") and ``found_by`` (which part of the
  solver found the schedule: its own name for a heuristic; "hint", "warm start: ...",
  "cp-sat search: ...", "milp search (...)", "lp rounding: ..." for the exact solvers),
  and where known ``lower_bound`` (duration), ``time_to_best_s`` and ``history``
  ([[elapsed_s, duration], ...]).

  Raises:
    InfeasibleBudgetError: only where the bound is proven for every schedule of the
      graph: each solver starts with `RematGraph.require_feasible` (``budget_bytes``
      below ``graph.min_feasible_bytes``).
    NoScheduleFoundError: it found no schedule, whether it stopped (time limit) or
      proved that none of its own kind fits (a fixed order, C_v copies, no
      recomputation); that proves nothing about other schedules. Exact solvers put the
      least peak they proved for their model in ``restricted_bound_bytes``.
  """

  def __call__(
    self,
    graph: RematGraph,
    budget_bytes: int,
    *,
    time_limit_s: float,
    workers: int,
    progress: ProgressCallback | None,
    **options: Any,
  ) -> Schedule: ...


# name -> "module:function", imported on first use so that a solver's heavy
# dependencies load only when it runs.
_REGISTRY: dict[str, str] = {
  "noremat": "jaxremat._src.solvers.noremat:solve_noremat",
  "auto": "jaxremat._src.solvers.auto:solve_auto",
  "cover": "jaxremat._src.solvers.cover:solve_cover",
  "cover-staged": "jaxremat._src.solvers.cover:solve_cover_staged",
  "chen-greedy": "jaxremat._src.solvers.chen:solve_chen_greedy",
  "chen-greedy-ap": "jaxremat._src.solvers.chen:solve_chen_greedy_ap",
  "chen-sqrtn": "jaxremat._src.solvers.chen:solve_chen_sqrtn",
  "chen-sqrtn-ap": "jaxremat._src.solvers.chen:solve_chen_sqrtn_ap",
  "chen-search-ap": "jaxremat._src.solvers.chen:solve_chen_search_ap",
  "dots-saveable": "jaxremat._src.solvers.segments:solve_dots_saveable",
  "griewank": "jaxremat._src.solvers.griewank:solve_griewank",
  "griewank-ap": "jaxremat._src.solvers.griewank:solve_griewank_ap",
  "reorder": "jaxremat._src.solvers.reorder:solve_reorder",
  "segments": "jaxremat._src.solvers.segments:solve_segments",
  "twremat": "jaxremat._src.solvers.twremat:solve_twremat",
  "xla-greedy": "jaxremat._src.solvers.greedy:solve_xla_greedy",
  "moccasin": "jaxremat._src.solvers.moccasin:solve_moccasin",
  "checkmate": "jaxremat._src.solvers.checkmate:solve_checkmate",
  "checkmate-lp": "jaxremat._src.solvers.checkmate:solve_checkmate_lp",
}


def register_solver(name: str, target: str) -> None:
  """Adds a solver under ``name``; ``target`` is ``"package.module:function"``."""
  _REGISTRY[name] = target


def available_solvers() -> list[str]:
  """The names `jaxremat.solve` accepts."""
  return sorted(_REGISTRY)


# What `jaxremat.solve` passes every solver itself; not options a caller names.
_PASSED_BY_SOLVE = frozenset({"time_limit_s", "workers", "progress"})


def check_options(name: str, options: Mapping[str, Any]) -> None:
  """Raises TypeError naming the first of ``options`` that solver ``name`` does not take.

  Solvers take ``**_`` so that `jaxremat.solve` can pass them all the same arguments: a
  misspelled option would otherwise be dropped without a word."""
  params = inspect.signature(get_solver(name)).parameters.values()
  taken = {p.name for p in params if p.kind is p.KEYWORD_ONLY} - _PASSED_BY_SOLVE
  unknown = sorted(set(options) - taken)
  if unknown and not taken:
    raise TypeError(f"solver {name!r} takes no options; drop {', '.join(unknown)}.")
  if unknown:
    raise TypeError(
      f"solver {name!r} has no option {unknown[0]!r}; it takes {', '.join(sorted(taken))}, "
      f"each as a keyword argument (e.g. solver='auto', heuristics=('cover',), exact=None)."
    )


def get_solver(name: str) -> Solver:
  if name not in _REGISTRY:
    raise ValueError(
      f"solver={name!r} is not a known solver; choose one of {', '.join(available_solvers())}."
    )
  module, _, attr = _REGISTRY[name].partition(":")
  return getattr(importlib.import_module(module), attr)
