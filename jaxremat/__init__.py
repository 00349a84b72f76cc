"""jaxremat: make a JAX training step fit a memory budget at the least extra compute."""

from jaxremat._src.budget import parse_budget as parse_budget
from jaxremat._src.errors import BudgetError as BudgetError
from jaxremat._src.errors import FormatError as FormatError
from jaxremat._src.errors import InfeasibleBudgetError as InfeasibleBudgetError
from jaxremat._src.errors import JaxrematError as JaxrematError
from jaxremat._src.errors import NoScheduleFoundError as NoScheduleFoundError
from jaxremat._src.errors import SolverError as SolverError
from jaxremat._src.errors import UnsupportedError as UnsupportedError
from jaxremat._src.graph import Node as Node
from jaxremat._src.graph import RematGraph as RematGraph
from jaxremat._src.schedule import Schedule as Schedule
from jaxremat._src.schedule import schedule_from_computes as schedule_from_computes
from jaxremat._src.simulate import SimulationResult as SimulationResult
from jaxremat._src.simulate import baseline_schedule as baseline_schedule
from jaxremat._src.simulate import simulate as simulate
from jaxremat._src.solve import solve as solve
from jaxremat._src.solvers.base import Progress as Progress
from jaxremat._src.solvers.base import available_solvers as available_solvers

__version__ = "0.1.0"

__all__ = [
  "BudgetError",
  "FormatError",
  "InfeasibleBudgetError",
  "JaxrematError",
  "Node",
  "NoScheduleFoundError",
  "Progress",
  "RematGraph",
  "Schedule",
  "SimulationResult",
  "SolverError",
  "UnsupportedError",
  "available_solvers",
  "baseline_schedule",
  "parse_budget",
  "schedule_from_computes",
  "simulate",
  "solve",
]
