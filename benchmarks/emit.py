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
from jaxremat._src.verify import noise_envelope
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MIB = 2**20
PEAK_RTOL = 0.10
# Models whose 4-segment schedule is also emitted with every fence (the fence comparison).
FENCE_MODELS = ("mlp16", "mlp")


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


def schedules(graph, solvers, budgets, time_limit, segments=(2, 4, 8)):
  """Yields (source, budget fraction, schedule or None, note)."""
  yield "noremat", 1.0, jaxremat.baseline_schedule(graph), ""
  for k in segments:
    yield f"segments-{k}", None, segment_schedule(graph, k), ""
  for solver in solvers:
    for fraction in budgets:
      try:
        schedule = jaxremat.solve(graph, fraction, solver=solver, time_limit=time_limit, workers=1)
        yield solver, fraction, schedule, schedule.stats.get("status", "")
      except Exception as e:  # noqa: BLE001 - every failure becomes a row of the table
        yield solver, fraction, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def reason(row, other_pin_error=None):
  """The table's status for a measured row: ok, or what failed and why, from its numbers.

  ``baseline_error_percent`` is XLA's no-remat peak over the graph's (``sim+out``) for
  the same emission; ``calibrated_error_percent`` the schedule's XLA peak against
  ``sim+out`` scaled by that ratio; ``other_pin_error`` the calibrated error (a
  fraction) of the same schedule emitted with the other ``pin`` (None if not measured).
  """
  problems = []
  if not row["outputs_match"]:
    problems.append(
      f"outputs differ (noise ratio {row['noise_ratio']:.2g}, max abs error "
      f"{row['max_abs_error']:.2g})"
    )
  lost = row["planned_expensive"] - row["kept_expensive"]
  if lost:
    problems.append(
      f"XLA merged {lost} of {row['planned_expensive']} planned dots/convs away, so the "
      "peak is not the plan's"
    )
  elif abs(row["peak_error_percent"]) > 100 * PEAK_RTOL:
    out_mib = row["predicted_xla_mib"] - row["predicted_mib"]
    calibrated = row["calibrated_error_percent"]
    baseline = row["baseline_error_percent"]
    if abs(row["xla_peak_error_percent"]) <= 100 * PEAK_RTOL:
      problems.append(
        f"XLA output buffers: {out_mib:.1f} MiB reserved from the start "
        f"(sim+out {row['xla_peak_error_percent']:+.1f}%)"
      )
    elif abs(calibrated) <= 100 * PEAK_RTOL:
      problems.append(
        f"graph baseline already {baseline:+.0f}% (trace); corrected {calibrated:+.1f}%"
      )
    elif other_pin_error is not None and abs(other_pin_error) <= PEAK_RTOL:
      other = "recomputations" if row["pin"] == "all" else "all"
      problems.append(
        f"XLA's own order: corrected {calibrated:+.0f}% here, "
        f"{100 * other_pin_error:+.1f}% with pin={other}"
      )
    else:
      extra_mib = row["xla_peak_mib"] - row["predicted_xla_mib"] * (1 + baseline / 100)
      where = (
        "with the schedule's order pinned: buffers the graph does not model"
        if row["pin"] == "all"
        else "order of first computations left to XLA"
      )
      problems.append(
        f"XLA {extra_mib:+.1f} MiB ({calibrated:+.0f}%) over the plan corrected for the "
        f"graph baseline ({baseline:+.0f}%), {where}"
      )
  return "; ".join(problems) or "ok"


def restatus(rows, default_fence_name):
  """Fills each measured row's status (after every pin of its schedule is measured)."""
  by_schedule = {}
  for row in rows:
    if "xla_peak_mib" in row and row["fence"] == default_fence_name:
      key = (row["model"], row["schedule"], row["budget"])
      by_schedule.setdefault(key, {})[row["pin"]] = row["calibrated_error_percent"] / 100
  for row in rows:
    if "xla_peak_mib" not in row:
      continue
    others = by_schedule.get((row["model"], row["schedule"], row["budget"]), {})
    other = [c for p, c in others.items() if p != row["pin"]]
    mine = row["fence"] == default_fence_name
    row["status"] = reason(row, other[0] if other and mine else None)
  return rows


def run_model(
  name, solvers, budgets, time_limit, runs, saved, pins, segments, checkpoint=lambda rows: None
):
  fn, args = load_model(name)
  t0 = time.perf_counter()
  program = jaxremat.trace_program(fn, *args, costs="xla")
  trace_s = time.perf_counter() - t0
  graph = program.graph
  print(f"# {name}: {graph!r}, traced in {trace_s:.1f} s", flush=True)
  original = jaxremat.measure(fn, *args, runs=runs)
  # The original's outputs and float noise, made once for every schedule's comparison.
  envelope = noise_envelope(fn, *args)
  fence = default_fence()
  # XLA's no-remat peak over the graph's, per emission (pin): how far the graph misjudges
  # this model before any remat (a tracing error, the same for every schedule); the
  # calibrated error isolates what the schedule and its emission add.
  baseline_ratio = {}
  rows = []
  measured = {}  # schedule events -> the rows measured for them (solvers often agree)
  for source, fraction, schedule, note in schedules(graph, solvers, budgets, time_limit, segments):
    if schedule is not None and schedule.events in measured:
      for done in measured[schedule.events]:
        same = done["schedule"] + ("" if done["budget"] is None else f"@{done['budget']}")
        rows.append({**done, "schedule": source, "budget": fraction, "note": f"same as {same}"})
        print(_line(rows[-1]), flush=True)
      continue
    variants = [(fence, pin) for pin in pins]
    if source == "segments-4" and name in FENCE_MODELS:
      variants += [
        (f, pins[0]) for f in ("cond", "cond-branch", "select", "barrier", "none") if f != fence
      ]
    if schedule is not None:
      saved[f"{name}/{source}/{fraction}"] = schedule.to_dict()
    pending = []
    for f, pin in variants if schedule is not None else [(fence, pins[0])]:
      row = {
        "model": name,
        "schedule": source,
        "budget": fraction,
        "fence": f,
        "pin": pin,
        "note": note,
        "backend": jax.default_backend(),
      }
      rows.append(row)
      if schedule is None:
        row["status"] = f"no schedule: {note}"
        print(_line(row), flush=True)
        continue
      try:
        emitted = jaxremat.emit(program, schedule, fence=f, pin=pin)
        v = jaxremat.verify(
          fn, emitted, schedule, *args, runs=runs, original=original, envelope=envelope
        )
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(_line(row), flush=True)
        continue
      if source == "noremat":
        baseline_ratio[pin] = v.measured_peak_bytes / v.predicted_xla_peak_bytes
      ratio = baseline_ratio.get(pin, original.peak_bytes / xla_accounted_peak_bytes(graph))
      calibrated = v.measured_peak_bytes / (v.predicted_xla_peak_bytes * ratio) - 1
      sim = jaxremat.simulate(graph, schedule)
      row.update(
        {
          "n_recompute": sim.n_recompute,
          "n_fences": emitted.n_fences,
          "planned_expensive": v.n_planned_recomputes,
          "kept_expensive": v.n_surviving_recomputes,
          "outputs_match": v.outputs_match,
          "max_abs_error": v.max_abs_error,
          "noise_ratio": v.noise_ratio,
          "predicted_mib": round(v.predicted_peak_bytes / MIB, 2),
          "predicted_xla_mib": round(v.predicted_xla_peak_bytes / MIB, 2),
          "xla_peak_mib": round(v.measured_peak_bytes / MIB, 2),
          "peak_error_percent": round(100 * v.peak_error, 1),
          "xla_peak_error_percent": round(100 * v.xla_peak_error, 1),
          "baseline_error_percent": round(100 * (ratio - 1), 1),
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
          "compile_s": round(v.emitted.compile_time_s, 1),
          "device_peak_mib": (
            round(v.emitted.device_peak_bytes / MIB, 2) if v.emitted.device_peak_bytes else None
          ),
        }
      )
      pending.append(row)
    for row in restatus(pending, fence):
      print(_line(row), flush=True)
    if pending:
      measured[schedule.events] = pending
    checkpoint(rows)
  return rows


def _pct(x):
  return None if x is None else round(100 * x, 1)


COLUMNS = [
  ("model", "model"),
  ("schedule", "schedule"),
  ("budget", "budget"),
  ("fence", "fence"),
  ("pin", "pin"),
  ("n_recompute", "recomp"),
  ("planned_expensive", "planned dots/convs"),
  ("kept_expensive", "kept in HLO"),
  ("outputs_match", "outputs+grads allclose"),
  ("predicted_mib", "sim MiB"),
  ("predicted_xla_mib", "sim+out MiB"),
  ("xla_peak_mib", "XLA MiB"),
  ("peak_error_percent", "error %"),
  ("calibrated_error_percent", "baseline-corrected %"),
  ("xla_temp_mib", "XLA temp MiB"),
  ("temp_change_percent", "temp %"),
  ("planned_flops_percent", "plan FLOPs %"),
  ("xla_flops_percent", "XLA FLOPs %"),
  ("time_ratio", "time x"),
  ("status", "reason (computed)"),
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
        _, (y,) = apply_fence(fence, x[-1], [x])
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


def summarize(rows, default_fence_name):
  """Per model and pin, over the default fence's rows: how many pass each check."""
  out = []
  for model in dict.fromkeys(r["model"] for r in rows):
    for pin in dict.fromkeys(r["pin"] for r in rows if r["model"] == model):
      mine = [
        r
        for r in rows
        if r["model"] == model and r["pin"] == pin and r["fence"] == default_fence_name
      ]
      done = [r for r in mine if "xla_peak_mib" in r]

      def count(test, done=done):
        return f"{sum(1 for r in done if test(r))}/{len(done)}"

      out.append(
        {
          "model": model,
          "pin": pin,
          "schedules": len(done),
          "outputs_allclose": count(lambda r: r["outputs_match"]),
          "recomputes_kept": count(lambda r: r["kept_expensive"] == r["planned_expensive"]),
          "within_10pct_sim": count(lambda r: abs(r["peak_error_percent"]) <= 100 * PEAK_RTOL),
          "within_10pct_sim_out": count(
            lambda r: abs(r["xla_peak_error_percent"]) <= 100 * PEAK_RTOL
          ),
          "within_10pct_corrected": count(
            lambda r: abs(r["calibrated_error_percent"]) <= 100 * PEAK_RTOL
          ),
          "no_schedule": sum(1 for r in mine if "xla_peak_mib" not in r),
        }
      )
  for row in out:
    print("| " + " | ".join(str(x) for x in row.values()) + " |")
  return out


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
  parser.add_argument(
    "--pins", default="all", help="comma-separated emit(pin=...) values, the first one default"
  )
  parser.add_argument("--segments", default="2,4,8", help="segment counts ('' for none)")
  parser.add_argument("--out", default=os.path.join(RESULTS, "emit"))
  parser.add_argument(
    "--merge",
    default="",
    help="comma-separated table prefixes (e.g. from parallel runs) to merge into --out: "
    "statuses are recomputed, the table and summary written; nothing is measured",
  )
  ns = parser.parse_args()
  if ns.merge:
    rows = []
    for prefix in ns.merge.split(","):
      with open(prefix + "_table.json") as f:
        rows += json.load(f)
    finish(restatus(rows, default_fence()), ns.out)
    return
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
    done = list(rows)
    rows += run_model(
      name,
      solvers,
      budgets,
      ns.time_limit,
      ns.runs,
      saved,
      ns.pins.split(","),
      [int(k) for k in ns.segments.split(",") if k],
      checkpoint=lambda partial, done=done: save(done + partial, ns.out + "_table"),
    )
    save(rows, ns.out + "_table")
    with open(ns.out + "_schedules.json", "w") as f:
      json.dump(saved, f)
  finish(rows, ns.out)


def by_schedule(rows, default_fence_name):
  """One markdown line per model x schedule x budget (default fence), both pins side by side."""
  lines = [
    "| model | schedule | budget | recomp. | dots/convs kept/planned | outputs+grads allclose "
    "| sim MiB | sim+out MiB | XLA MiB | error | baseline-corrected | XLA MiB, pin=recomputations "
    "| FLOPs plan / XLA | reason (computed) |",
    "|" + "---|" * 14,
  ]
  groups = {}
  for row in rows:
    if row["fence"] == default_fence_name:
      groups.setdefault((row["model"], row["schedule"], row["budget"]), {})[row["pin"]] = row
  for (model, source, budget), pins in groups.items():
    row = pins.get("all") or next(iter(pins.values()))
    if "xla_peak_mib" not in row:
      lines.append(f"| {model} | {source} | {budget or ''} | | | | | | | | | | | {row['status']} |")
      continue
    loose = pins.get("recomputations") if row["pin"] == "all" else None
    note = f" ({row['note']})" if row.get("note", "").startswith("same as") else ""
    lines.append(
      f"| {model} | {source}{note} | {budget or ''} | {row['n_recompute']} "
      f"| {row['kept_expensive']}/{row['planned_expensive']} | {row['outputs_match']} "
      f"| {row['predicted_mib']} | {row['predicted_xla_mib']} | {row['xla_peak_mib']} "
      f"| {row['peak_error_percent']:+.1f}% | {row['calibrated_error_percent']:+.1f}% "
      f"| {loose['xla_peak_mib'] if loose and 'xla_peak_mib' in loose else ''} "
      f"| {_signed(row['planned_flops_percent'])} / {_signed(row['xla_flops_percent'])} "
      f"| {row['status']} |"
    )
  return lines


def _signed(x):
  return "" if x is None else f"{x:+.1f}%"


def finish(rows, out):
  """Saves the table (CSV, JSON, markdown) and prints and saves the summary."""
  save(rows, out + "_table")
  with open(out + "_table.md", "w") as f:
    f.write("| " + " | ".join(title for _, title in COLUMNS) + " |\n")
    f.write("|" + "---|" * len(COLUMNS) + "\n")
    f.writelines(_line(row) + "\n" for row in rows)
  with open(out + "_by_schedule.md", "w") as f:
    f.writelines(line + "\n" for line in by_schedule(rows, default_fence()))
  print("## summary")
  save(summarize(rows, default_fence()), out + "_summary")


if __name__ == "__main__":
  main()
