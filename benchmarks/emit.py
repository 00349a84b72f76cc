"""Emit and verify every schedule jaxremat can make: same values, recomputation kept, XLA's peak.

Usage: python -m benchmarks.emit [--models mlp16,mlp,gpt,unet,resnet] [--solvers all]
       [--budgets 0.9,0.7,0.5] [--time-limit 20] [--runs 3]

For each model (the 16-layer tanh MLP of ARCHITECTURE.md fact 1, batch 4096, width 256,
and the value_and_grad steps of examples/) it traces the step, builds segment
checkpointing schedules (2, 4 and 8 segments) and asks every registered solver for a
schedule at each budget (a fraction of the simulated baseline peak); then emits each
schedule with the backend's fence and runs `jaxremat.verify`: outputs against the
original (rtol 1e-5), planned expensive recomputations against the optimized HLO, the
simulator's peak against XLA's memory_analysis. The 4-segment schedules are also emitted
with every fence, and a micro benchmark measures what one fence costs.

Prints markdown tables and writes benchmarks/results/emit_table.{csv,json},
benchmarks/results/emit_fences.{csv,json} and the schedules to emit_schedules.json.
"""

import argparse
import csv
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp

import examples
import jaxremat
from jaxremat._src.emit import apply_fence, default_fence
from jaxremat._src.segments import segment_schedule
from jaxremat._src.trace import xla_accounted_peak_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MIB = 2**20
PEAK_RTOL = 0.10


def mlp16():
  """ARCHITECTURE.md fact 1: 16 tanh layers, batch 4096, width 256, float32, grad of a sum."""

  def loss(params, x):
    h = x
    for w in params:
      h = jnp.tanh(h @ w)
    return jnp.sum(h)

  key = jax.random.key(0)
  params = [jax.random.normal(jax.random.fold_in(key, i), (256, 256)) / 16 for i in range(16)]
  return jax.grad(loss), (params, jax.random.normal(key, (4096, 256)))


def load_model(name):
  if name == "mlp16":
    return mlp16()
  return examples.load(name).make_grad_fn()


def schedules(graph, solvers, budgets, time_limit):
  """Yields (source, budget fraction, schedule or None, note)."""
  yield "noremat", 1.0, jaxremat.baseline_schedule(graph), ""
  for k in (2, 4, 8):
    yield f"segments-{k}", None, segment_schedule(graph, k), ""
  for solver in solvers:
    for fraction in budgets:
      try:
        schedule = jaxremat.solve(graph, fraction, solver=solver, time_limit=time_limit, workers=1)
        yield solver, fraction, schedule, schedule.stats.get("status", "")
      except Exception as e:  # noqa: BLE001 - every failure becomes a row of the table
        yield solver, fraction, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def why(v, calibrated_error):
  """The table's status: ok, or what failed and the known reason."""
  problems = []
  if not v.outputs_match:
    problems.append(f"outputs differ (max abs error {v.max_abs_error:.2g})")
  if not v.recomputes_survive:
    problems.append(
      f"XLA merged recomputations (planned {dict(v.planned_recomputes)}, "
      f"kept {dict(v.surviving_recomputes)})"
    )
  if abs(v.peak_error) > PEAK_RTOL:
    if abs(v.xla_peak_error) <= PEAK_RTOL:
      problems.append(
        f"peak {100 * v.peak_error:+.0f}%: XLA holds output buffers from the start "
        f"(accounted prediction {100 * v.xla_peak_error:+.1f}%)"
      )
    elif abs(calibrated_error) <= PEAK_RTOL:
      problems.append(
        f"peak {100 * v.peak_error:+.0f}% (accounted {100 * v.xla_peak_error:+.0f}%): the "
        f"graph misjudges this model's baseline by as much; against it {calibrated_error:+.1%}"
      )
    else:
      problems.append(
        f"peak {100 * v.peak_error:+.0f}% (accounted {100 * v.xla_peak_error:+.0f}%, "
        f"baseline-calibrated {calibrated_error:+.0%}): XLA does not run the plan's order"
      )
  return "; ".join(problems) or "ok"


def run_model(name, solvers, budgets, time_limit, runs, saved):
  fn, args = load_model(name)
  t0 = time.perf_counter()
  program = jaxremat.trace_program(fn, *args, costs="xla")
  trace_s = time.perf_counter() - t0
  graph = program.graph
  print(f"# {name}: {graph!r}, traced in {trace_s:.1f} s", flush=True)
  original = jaxremat.measure(fn, *args, runs=runs)
  # How far the graph misjudges XLA's peak with no remat at all (a tracing error, the
  # same for every schedule); the calibrated error isolates what emission adds.
  baseline_ratio = original.peak_bytes / xla_accounted_peak_bytes(graph)
  fence = default_fence()
  rows = []
  for source, fraction, schedule, note in schedules(graph, solvers, budgets, time_limit):
    fences = [fence]
    if source == "segments-4":
      fences = [fence] + [
        f for f in ("cond", "cond-branch", "select", "barrier", "none") if f != fence
      ]
    if schedule is not None:
      saved[f"{name}/{source}/{fraction}"] = schedule.to_dict()
    for f in fences if schedule is not None else [fence]:
      row = {
        "model": name,
        "schedule": source,
        "budget": fraction,
        "fence": f,
        "note": note,
        "backend": jax.default_backend(),
      }
      rows.append(row)
      if schedule is None:
        row["status"] = f"no schedule: {note}"
        print(_line(row), flush=True)
        continue
      try:
        emitted = jaxremat.emit(program, schedule, fence=f)
        v = jaxremat.verify(fn, emitted, schedule, *args, runs=runs, original=original)
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(_line(row), flush=True)
        continue
      sim = jaxremat.simulate(graph, schedule)
      calibrated = v.measured_peak_bytes / (v.predicted_xla_peak_bytes * baseline_ratio) - 1
      row.update(
        {
          "n_recompute": sim.n_recompute,
          "n_fences": emitted.n_fences,
          "planned_expensive": sum(v.planned_recomputes.values()),
          "kept_expensive": sum(v.surviving_recomputes.get(op, 0) for op in v.planned_recomputes),
          "outputs_match": v.outputs_match,
          "max_abs_error": v.max_abs_error,
          "predicted_mib": round(v.predicted_peak_bytes / MIB, 2),
          "predicted_xla_mib": round(v.predicted_xla_peak_bytes / MIB, 2),
          "xla_peak_mib": round(v.measured_peak_bytes / MIB, 2),
          "peak_error_percent": round(100 * v.peak_error, 1),
          "xla_peak_error_percent": round(100 * v.xla_peak_error, 1),
          "calibrated_error_percent": round(100 * calibrated, 1),
          "xla_temp_mib": round(v.emitted.temp_bytes / MIB, 2),
          "temp_change_percent": round(
            100 * (v.emitted.temp_bytes / max(v.original.temp_bytes, 1) - 1), 1
          ),
          "planned_flops_percent": _pct(v.planned_flops_increase),
          "xla_flops_percent": _pct(v.measured_flops_increase),
          "time_ratio": (
            round(v.emitted.wall_time_s / v.original.wall_time_s, 3)
            if v.emitted.wall_time_s and v.original.wall_time_s
            else None
          ),
          "device_peak_mib": (
            round(v.emitted.device_peak_bytes / MIB, 2) if v.emitted.device_peak_bytes else None
          ),
          "status": why(v, calibrated),
        }
      )
      print(_line(row), flush=True)
  return rows


def _pct(x):
  return None if x is None else round(100 * x, 1)


COLUMNS = [
  ("model", "model"),
  ("schedule", "schedule"),
  ("budget", "budget"),
  ("fence", "fence"),
  ("n_recompute", "recomp"),
  ("planned_expensive", "planned dots/convs"),
  ("kept_expensive", "kept in HLO"),
  ("outputs_match", "outputs ok"),
  ("predicted_mib", "sim MiB"),
  ("predicted_xla_mib", "sim+out MiB"),
  ("xla_peak_mib", "XLA MiB"),
  ("calibrated_error_percent", "calib. %"),
  ("xla_temp_mib", "XLA temp MiB"),
  ("temp_change_percent", "temp %"),
  ("planned_flops_percent", "plan FLOPs %"),
  ("xla_flops_percent", "XLA FLOPs %"),
  ("time_ratio", "time x"),
  ("status", "status"),
]


def _line(row):
  return "| " + " | ".join("" if row.get(k) is None else str(row.get(k)) for k, _ in COLUMNS) + " |"


def fence_costs(runs):
  """What one fence costs on a value of each size: y = fence(t, x); return sum(y * 2)."""
  rows = []
  for mib in (1, 16, 64):
    x = jnp.ones((mib * MIB // 4 // 1024, 1024), jnp.float32)
    for fence in ("none", "cond", "select", "barrier"):

      def f(x, fence=fence):
        (y,) = apply_fence(fence, x[-1], [x])
        return jnp.sum(y * 2.0)

      m = jaxremat.measure(f, x, runs=runs, warmup=2)
      rows.append(
        {
          "value_mib": mib,
          "fence": fence,
          "xla_temp_mib": round(m.temp_bytes / MIB, 3),
          "xla_peak_mib": round(m.peak_bytes / MIB, 3),
          "wall_ms": round(1e3 * m.wall_time_s, 3),
          "backend": m.backend,
        }
      )
      print(rows[-1], flush=True)
  return rows


def save(rows, path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  keys = list(dict.fromkeys(k for row in rows for k in row))
  with open(path + ".csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
  with open(path + ".json", "w") as f:
    json.dump(rows, f, indent=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp16," + ",".join(examples.EXAMPLES))
  parser.add_argument("--solvers", default="all", help="comma-separated, or 'all' registered")
  parser.add_argument("--budgets", default="0.9,0.7,0.5")
  parser.add_argument("--time-limit", type=float, default=20.0)
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(RESULTS, "emit"))
  ns = parser.parse_args()
  solvers = (
    [s for s in jaxremat.available_solvers() if s != "noremat"]
    if ns.solvers == "all"
    else [s for s in ns.solvers.split(",") if s]
  )
  budgets = [float(b) for b in ns.budgets.split(",")]
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, solvers {solvers}")
  print("## fence cost")
  save(fence_costs(ns.runs), ns.out + "_fences")
  print("## schedules")
  print("| " + " | ".join(title for _, title in COLUMNS) + " |")
  print("|" + "---|" * len(COLUMNS))
  rows, saved = [], {}
  for name in filter(None, ns.models.split(",")):
    rows += run_model(name, solvers, budgets, ns.time_limit, ns.runs, saved)
    save(rows, ns.out + "_table")
    with open(ns.out + "_schedules.json", "w") as f:
      json.dump(saved, f)


if __name__ == "__main__":
  main()
