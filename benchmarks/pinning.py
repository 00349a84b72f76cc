"""Which fence the first plan should get: its recomputations only, or its whole order.

For each example training step and budget, the plan `jaxremat.optimize` makes first
(solver ``auto``, planned below the budget by what the compiler holds beyond the model on
the original step, in the order `_Loop.resequenced` gives it) is emitted twice, with
``pin="recomputations"`` and with ``pin="all"``, and compiled for the target. Prints the
compiler's peak and FLOPs of each against no remat, the model's peak and FLOPs beside
them, and saves ``benchmarks/results/pinning_<target>.{csv,json}``.

With ``--policy``, the plan of ``jax.checkpoint``'s ``dots_saveable`` policy (solver
``dots-saveable``, in the order `_Loop.resequenced` gives it) is compiled with each of
`emit`'s pins, beside JAX's own ``dots_saveable`` step; results in
``pinning_policy_<target>``.

  python -m benchmarks.pinning --target h100
  python -m benchmarks.pinning --target cpu --examples unet,vgg16 --budgets 0.7
  python -m benchmarks.pinning --target h100 --policy
  python -m benchmarks.pinning --target tpu-v5e --batch-scale 8  # past on-chip memory
"""

from __future__ import annotations

import argparse
import pathlib

import jaxremat
from benchmarks.e2e import example_step
from benchmarks.emit import save
from jaxremat._src.emit import PINS
from jaxremat._src.planner import PlanOptions, _Deadline, _Loop, model_flops
from jaxremat._src.signature import call_signature
from jaxremat._src.solve import solve

EXAMPLES = ("mlp", "gpt", "unet", "resnet", "vgg16", "mobilenet")


def _planning_loop(name: str, budget: float, target, deadline_s: float, batch_scale: int = 1):
  """The example step's args, baseline and the planner's loop at ``budget`` of its peak."""
  step, args = example_step(name, None, batch_scale=batch_scale)
  signature = call_signature(args, {})
  program = jaxremat.trace_program(step, *args, signature=signature, target=target)
  baseline = program.baseline or jaxremat.measure(step, *args, runs=0, target=target)
  budget_bytes = jaxremat.parse_budget(budget, baseline.peak_bytes)
  opts = PlanOptions(budget=budget, target=target, progress=False, verify=False)
  loop = _Loop(program, signature, budget_bytes, opts, _Deadline(deadline_s), baseline)
  return args, baseline, loop


def first_plan_pinned_both_ways(
  name: str, budget: float, target, time_limit_s: float, batch_scale: int = 1
) -> dict:
  """One row: the first plan of ``optimize`` at ``budget``, compiled with each pin."""
  _, baseline, loop = _planning_loop(name, budget, target, 10 * time_limit_s, batch_scale)
  planning = loop.solver_budget(loop.first_planning_bytes())
  schedule = loop.solve(lambda graph: solve(graph, planning, "auto", time_limit=time_limit_s))
  row = {"example": name, "budget": budget, "solver": schedule.stats.get("found_by", "auto")}
  for pin in ("recomputations", "all"):
    tried = loop._measure(schedule.replace(stats={**schedule.stats, "pin": pin}), "solve")
    row[f"peak_{pin}"] = tried.compiled.peak_bytes / baseline.peak_bytes
    row[f"flops_{pin}"] = tried.attempt.flops / baseline.flops
    row[f"kept_{pin}"] = tried.kept
  row["predicted"] = loop.predicted_peak_bytes(schedule) / baseline.peak_bytes
  graph = loop.program.graph
  row["flops_model"] = model_flops(graph, schedule.computes) / model_flops(graph, graph.order)
  return row


def policy_plan_every_way(name: str, target) -> dict:
  """One row: the plan of ``dots_saveable`` compiled with each pin, and JAX's policy."""
  args, baseline, loop = _planning_loop(name, 1.0, target, 600.0)
  schedule = loop.solve(lambda graph: solve(graph, 2**40, "dots-saveable"))
  row = {"example": name}
  for pin in PINS:
    tried = loop._measure(schedule.replace(stats={**schedule.stats, "pin": pin}), "policy")
    row[f"peak_{pin}"] = tried.compiled.peak_bytes / baseline.peak_bytes
    row[f"flops_{pin}"] = tried.attempt.flops / baseline.flops
  policy_step, _ = example_step(name, "dots_saveable")
  policy = jaxremat.measure(policy_step, *args, runs=0, target=target)
  row["peak_jax"] = policy.peak_bytes / baseline.peak_bytes
  row["flops_jax"] = policy.flops / baseline.flops
  row["predicted"] = loop.predicted_peak_bytes(schedule) / baseline.peak_bytes
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="cpu", help="jaxremat.get_target name")
  parser.add_argument("--examples", default=",".join(EXAMPLES))
  parser.add_argument("--budgets", default="0.7,0.5")
  parser.add_argument("--time-limit", type=float, default=10.0, help="seconds for the solve")
  parser.add_argument("--policy", action="store_true", help="the dots_saveable plan, every pin")
  parser.add_argument("--batch-scale", type=int, default=1, help="multiplies each batch size")
  a = parser.parse_args()
  target = jaxremat.get_target(None if a.target == "cpu" else a.target)
  rows = []
  for name in a.examples.split(","):
    for budget in [None] if a.policy else [float(b) for b in a.budgets.split(",")]:
      try:
        if budget is None:
          row = policy_plan_every_way(name, target)
        else:
          row = first_plan_pinned_both_ways(name, budget, target, a.time_limit, a.batch_scale)
      except jaxremat.JaxrematError as e:  # no plan within the planning budget
        row = {"example": name, "budget": budget, "error": f"{type(e).__name__}: {e}"[:200]}
      rows.append(row)
      print(
        " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
        flush=True,
      )
  stem = f"pinning_policy_{a.target}" if a.policy else f"pinning_{a.target}"
  stem += f"_batchx{a.batch_scale}" if a.batch_scale != 1 else ""
  save(rows, str(pathlib.Path(__file__).parent / "results" / stem))


if __name__ == "__main__":
  main()
