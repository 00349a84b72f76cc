"""Errors raised at jaxremat's public boundary.

Every message is a full sentence that names the argument or item, shows the value and
says how to fix it.
"""

from __future__ import annotations


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
  """No schedule can meet the budget.

  Attributes:
    budget_bytes: the budget asked for.
    min_feasible_bytes: a proven lower bound on the peak of any valid schedule; budgets
      below it are infeasible. Where a solver also proved it reachable, it is exact.
  """

  def __init__(self, budget_bytes: int, min_feasible_bytes: int, reason: str = ""):
    self.budget_bytes = int(budget_bytes)
    self.min_feasible_bytes = int(min_feasible_bytes)
    self.reason = reason
    detail = f": {reason}" if reason else ""
    super().__init__(
      f"budget={self.budget_bytes} bytes is below the smallest feasible peak of "
      f"{self.min_feasible_bytes} bytes{detail}. Raise the budget to at least "
      f"{self.min_feasible_bytes} bytes or shrink the model."
    )


class NoScheduleFoundError(JaxrematError, RuntimeError):
  """A solver ended (time limit, node limit) without any schedule within the budget.

  Unlike :class:`InfeasibleBudgetError` this proves nothing: a longer time limit or
  another solver may still succeed.
  """


class SolverError(JaxrematError, RuntimeError):
  """A solver broke its contract (e.g. returned a schedule the simulator rejects)."""


class UnsupportedError(JaxrematError, ValueError):
  """A program uses something jaxremat cannot plan or emit (e.g. an effect)."""


class VerificationError(JaxrematError, RuntimeError):
  """An optimized function's outputs differ from the original's, or XLA dropped a planned
  recomputation: jaxremat refuses to hand it out."""
