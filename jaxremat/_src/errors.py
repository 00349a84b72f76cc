"""Errors raised at jaxremat's public boundary.

Every message is a full sentence that names the argument or item, shows the value and
says how to fix it.
"""

from __future__ import annotations

from typing import Any


class JaxrematError(Exception):
  """Base class of every error jaxremat raises on purpose."""


class FormatError(JaxrematError, ValueError):
  """A graph or schedule (file or dict) does not follow FORMATS.md.

  Attributes:
    source: the file path or a description of where the data came from.
    item: the offending item, e.g. ``"nodes[3].mem"`` or ``"events[12]"``.
  """

  def __init__(self, source: str, item: str, problem: str):
    self.source = source
    self.item = item
    self.problem = problem
    where = f"{source}: {item}" if item else source
    super().__init__(f"{where}: {problem}")


class BudgetError(JaxrematError, ValueError):
  """A memory budget that cannot be parsed or makes no sense."""


class InfeasibleBudgetError(JaxrematError, ValueError):
  """No schedule can meet the budget, and there is a proof.

  Attributes:
    budget_bytes: the budget asked for.
    min_feasible_bytes: a proven lower bound on the peak of every valid schedule (of the
      graph, or of the compiled step where `jaxremat.optimize` raises it); budgets below
      it are infeasible. It is a bound, not a promise that it can be reached.
    reason: the proof, in words.
  """

  def __init__(self, budget_bytes: int, min_feasible_bytes: int, reason: str = ""):
    self.budget_bytes = int(budget_bytes)
    self.min_feasible_bytes = int(min_feasible_bytes)
    self.reason = reason
    detail = f": {reason}" if reason else ""
    super().__init__(
      f"budget={self.budget_bytes} bytes is below the smallest feasible peak of "
      f"{self.min_feasible_bytes} bytes{detail}. Raise the budget to at least "
      f"{self.min_feasible_bytes} bytes (no schedule goes below it) or shrink the model."
    )


class BudgetNotMetError(JaxrematError, RuntimeError):
  """No plan jaxremat found meets the budget as the compiler measures it; nothing about the
  compiler is proven. Where the budget is below every plan of jaxremat's model of the step,
  the message gives that bound and the node that sets it (a proof in the model).

  The best plan found is kept, verified, so that it can be used as it is; where no plan
  the compiler measured holds less than the step itself, that is the step, unchanged.

  Attributes:
    budget_bytes: the budget asked for.
    measured_peak_bytes: the compiler's peak of the best plan found (the least).
    plan: that plan (a `jaxremat.Plan`; ``plan.compiled`` runs it).
    lower_bound_bytes: the proven lower bound (no plan can be below it).
  """

  def __init__(
    self,
    budget_bytes: int,
    plan: Any,
    lower_bound_bytes: int,
    detail: str = "",
    cached: bool = True,
    hint: str = "",
  ):
    self.budget_bytes = int(budget_bytes)
    self.plan = plan
    self.measured_peak_bytes = int(plan.measured_peak_bytes)
    self.lower_bound_bytes = int(lower_bound_bytes)
    retry = (
      f"Retry with budget={self.measured_peak_bytes} or more to use that plan (the plan "
      "cache keeps it), raise"
      if cached
      else "Raise"
    )
    super().__init__(
      f"No plan that jaxremat found meets budget={self.budget_bytes} bytes as the compiler "
      f"measures it{detail}; the best measures {self.measured_peak_bytes} bytes. {retry} "
      "time_limit to search longer, or catch BudgetNotMetError and run its .plan.compiled. "
      f"No plan can go below {self.lower_bound_bytes} bytes (the step's arguments and "
      f"outputs).{hint}"
    )


class NoScheduleFoundError(JaxrematError, RuntimeError):
  """A solver ended (time limit, node limit, its own model) without any schedule within the
  budget.

  Unlike :class:`InfeasibleBudgetError` this proves nothing about the graph: a longer time
  limit or another solver may still succeed.

  Attributes:
    restricted_bound_bytes: where an exact solver proved its own restricted model
      infeasible (C_v copies, a staged or input order), the least peak of that model's
      schedules; None otherwise.
    least_peak_bytes: where a heuristic reached schedules over the budget, the least peak
      among them (planning within it finds one); None otherwise.
  """

  def __init__(
    self,
    message: str,
    restricted_bound_bytes: int | None = None,
    least_peak_bytes: int | None = None,
  ):
    super().__init__(message)
    self.restricted_bound_bytes = (
      None if restricted_bound_bytes is None else int(restricted_bound_bytes)
    )
    self.least_peak_bytes = None if least_peak_bytes is None else int(least_peak_bytes)


class SolverError(JaxrematError, RuntimeError):
  """A solver broke its contract (e.g. returned a schedule the simulator rejects)."""


class TargetUnavailableError(JaxrematError, RuntimeError):
  """A target's compiler is not installed or could not start in this process."""


class UnsupportedError(JaxrematError, ValueError):
  """A program uses something jaxremat cannot plan or emit (e.g. an effect)."""


class VerificationError(JaxrematError, RuntimeError):
  """An optimized function's outputs differ from the original's, or XLA dropped a planned
  recomputation: jaxremat refuses to hand it out."""
