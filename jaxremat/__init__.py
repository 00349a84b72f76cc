"""jaxremat: make a JAX training step fit a memory budget at the least extra compute."""

from jaxremat._src.api import OptimizedFunction as OptimizedFunction
from jaxremat._src.api import optimize as optimize
from jaxremat._src.budget import parse_budget as parse_budget
from jaxremat._src.emit import emit as emit
from jaxremat._src.errors import BudgetError as BudgetError
from jaxremat._src.errors import BudgetNotMetError as BudgetNotMetError
from jaxremat._src.errors import FormatError as FormatError
from jaxremat._src.errors import InfeasibleBudgetError as InfeasibleBudgetError
from jaxremat._src.errors import JaxrematError as JaxrematError
from jaxremat._src.errors import NoScheduleFoundError as NoScheduleFoundError
from jaxremat._src.errors import SolverError as SolverError
from jaxremat._src.errors import TargetUnavailableError as TargetUnavailableError
from jaxremat._src.errors import UnsupportedError as UnsupportedError
from jaxremat._src.errors import VerificationError as VerificationError
from jaxremat._src.graph import Node as Node
from jaxremat._src.graph import RematGraph as RematGraph
from jaxremat._src.measure import Measurement as Measurement
from jaxremat._src.measure import measure as measure
from jaxremat._src.minimize import minimize_peak as minimize_peak
from jaxremat._src.planner import Plan as Plan
from jaxremat._src.program import Program as Program
from jaxremat._src.report import Report as Report
from jaxremat._src.schedule import Schedule as Schedule
from jaxremat._src.schedule import schedule_from_computes as schedule_from_computes
from jaxremat._src.simulate import SimulationResult as SimulationResult
from jaxremat._src.simulate import baseline_schedule as baseline_schedule
from jaxremat._src.simulate import simulate as simulate
from jaxremat._src.solve import solve as solve
from jaxremat._src.solvers.base import Progress as Progress
from jaxremat._src.solvers.base import available_solvers as available_solvers
from jaxremat._src.targets import Target as Target
from jaxremat._src.targets import available_targets as available_targets
from jaxremat._src.targets import get_target as get_target
from jaxremat._src.trace import save_graph as save_graph
from jaxremat._src.trace import trace as trace
from jaxremat._src.trace import trace_program as trace_program
from jaxremat._src.verify import OutputComparison as OutputComparison
from jaxremat._src.verify import Verification as Verification
from jaxremat._src.verify import compare_outputs as compare_outputs
from jaxremat._src.verify import verify as verify

__version__ = "0.1.0"

__all__ = [
  "BudgetError",
  "BudgetNotMetError",
  "FormatError",
  "InfeasibleBudgetError",
  "JaxrematError",
  "Measurement",
  "Node",
  "OptimizedFunction",
  "OutputComparison",
  "Plan",
  "NoScheduleFoundError",
  "Program",
  "Progress",
  "RematGraph",
  "Report",
  "Schedule",
  "SimulationResult",
  "SolverError",
  "Target",
  "TargetUnavailableError",
  "UnsupportedError",
  "Verification",
  "VerificationError",
  "available_solvers",
  "available_targets",
  "baseline_schedule",
  "compare_outputs",
  "emit",
  "get_target",
  "measure",
  "minimize_peak",
  "optimize",
  "parse_budget",
  "save_graph",
  "schedule_from_computes",
  "simulate",
  "solve",
  "trace",
  "trace_program",
  "verify",
]
