"""End to end against jax.checkpoint: what jaxremat gives a user over checkpointing by hand.

For each example training step (examples/: loss, value_and_grad, Adam) it measures, with
the target compiler's own figures (`jaxremat.measure`: the memory_analysis peak,
cost_analysis FLOPs, median wall time of calls timed in turn where the target's devices
are here):

* no remat (the reference: budgets are fractions of its peak);
* the jax.checkpoint variants a user would try (`examples._common.CHECKPOINT_VARIANTS`):
  policies ``nothing_saveable``, ``dots_saveable`` and
  ``dots_with_no_batch_dims_saveable`` over the whole loss, one checkpoint per block, and
  segments of sqrt(n) blocks; on TPU and GPU also the blocks' outputs offloaded to pinned
  host memory (``offload_blocks``);
* `jaxremat.optimize` (solver ``auto``) at each budget (0.9, 0.7, 0.5), with the peak its
  model predicted beside the one the compiler measured.

``--target tpu-v5e`` / ``--target h100`` compiles for that device without it
(`jaxremat.get_target`; extras ``tpu-aot`` / ``gpu-aot``): peaks and FLOPs are the target
compiler's, no wall time is taken, and outputs are checked on this machine's CPU.

For each it records the peak, the FLOP and wall-time ratios against no remat, which
budgets the peak meets as XLA measures it (for jaxremat also whether jaxremat reported the
budget met) and how its outputs agree with no remat's: the loss, and the gradient read from
Adam's first moment, which after one step from zero is exactly 0.1 x the gradient.

It then assembles the solver table on ../shared/graphs from the result files of
benchmarks/heuristics.py (`auto` at 0.8 against the best any solver reached) and
benchmarks/solvers.py (MOCCASIN against its reference), rerunning those parts first with
``--rerun-solvers``. Writes benchmarks/results/e2e.{csv,json}, e2e_solvers.csv and the
plots e2e.png (peak against FLOPs) and e2e_time.png (wall time).

Run from the repository root:
  python -m benchmarks.e2e                     # every example, every budget
  python -m benchmarks.e2e --rerun-solvers     # the same, and the solver benchmarks rerun
  python -m benchmarks.e2e --quick             # U-Net and ResNet at 0.7 (a few minutes)
  python -m benchmarks.e2e --target tpu-v5e    # for TPU v5e, on this machine
  python -m benchmarks.e2e --target tpu-v5e --batch-scale 8  # temporaries past TPU VMEM
  python -m benchmarks.e2e --device-peaks      # on a GPU or TPU: memory_stats peaks too
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import examples
import jaxremat
from examples import _common
from jaxremat import (
  BudgetNotMetError,
  InfeasibleBudgetError,
  NoScheduleFoundError,
  VerificationError,
)
from jaxremat._src.verify import NoiseEnvelope, compare_with_envelope, noise_envelope

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BUDGETS = (0.9, 0.7, 0.5)
QUICK_EXAMPLES = ("unet", "resnet")
QUICK_BUDGETS = (0.7,)


# -- measuring one step ---------------------------------------------------------------


def _rel_norm_error(got, want) -> float:
  errors = [
    float(np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
  ]
  return max(errors)


def agreement(outputs, envelope: NoiseEnvelope) -> dict:
  """How ``(params, opt_state, loss)`` agrees with no remat's, after one step.

  Outputs agree when they are within no remat's own float noise (`compare_outputs`, the
  check `jaxremat.optimize` makes); the loss and Adam's first moment are reported too.
  """
  (_, (adam, _), loss), (_, (ref_adam, _), ref_loss) = outputs, envelope.expected
  comparison = compare_with_envelope(envelope, outputs)
  return {
    "loss_rel_error": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
    "grad_rel_norm_error": _rel_norm_error(adam.mu, ref_adam.mu),
    "noise_ratio": comparison.noise_ratio,
    "outputs_agree": comparison.outputs_match,
  }


def _figures(m: jaxremat.Measurement, base: jaxremat.Measurement, budgets_bytes: dict) -> dict:
  return {
    "xla_peak_bytes": m.peak_bytes,
    "temp_bytes": m.temp_bytes,
    "peak_ratio": m.peak_bytes / base.peak_bytes,
    "flops": m.flops,
    "flops_ratio": m.flops / base.flops if m.flops and base.flops else None,
    "meets": {str(b): m.peak_bytes <= n for b, n in budgets_bytes.items()},
  }


def interleaved_times_s(calls: list, args, runs: int) -> list[float]:
  """Median seconds per call of each function, timed in turn, round after round.

  One untimed round first. Interleaving spreads a shared machine's drift over every
  method alike; timing each method's calls together biased whichever went first.
  """
  times: list[list[float]] = [[] for _ in calls]
  for k in range(runs + 1):
    for fn, t in zip(calls, times, strict=True):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      if k:
        t.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


def variants_for(target: jaxremat.Target) -> tuple[str, ...]:
  """The jax.checkpoint variants to compare on ``target``: offloading needs host memory."""
  offload = (_common.OFFLOAD_VARIANT,) if target.platform in ("tpu", "gpu") else ()
  return (*_common.CHECKPOINT_VARIANTS, *offload)


def example_step(name: str, variant: str | None, small: bool = False, batch_scale: int = 1):
  """One example's Adam training step, checkpointed by hand as ``variant``
  (`examples._common.checkpointed_loss`), and its arguments."""
  module = examples.load(name)
  sizes = dict(module.SMALL) if small else {}
  if batch_scale != 1:
    sizes["batch"] = sizes.get("batch", _common.default_batch(module)) * batch_scale
  params, batch = _common.example_args(module, **sizes)
  return _common.make_train_step(_common.checkpointed_loss(module, variant), params, batch)


def optimize_example(step, budget: float, time_limit_s: float, target, cache_dir=None, **kwargs):
  """`jaxremat.optimize` as this benchmark calls it; with ``cache_dir`` its plans are kept
  there, so that another process (benchmarks/device_peak.py) runs them without solving."""
  return jaxremat.optimize(
    step,
    budget=budget,
    solver="auto",
    time_limit=time_limit_s,
    cache_dir=cache_dir,
    use_cache=cache_dir is not None,
    progress=False,
    target=target,
    **kwargs,
  )


def run_example(
  name: str,
  budgets,
  time_limit_s: float,
  runs: int,
  small: bool,
  target: jaxremat.Target,
  batch_scale: int = 1,
  cache_dir: str | None = None,
  model: str = "auto",
) -> list[dict]:
  """Every method on one example's training step; one row per method (and budget).

  Wall times and the variants' outputs are taken only where ``target`` runs here.
  ``batch_scale`` multiplies the example's batch size. ``cache_dir``: keep the plans in
  this plan cache (default: no cache, every budget solved afresh). ``model``: the memory
  model `jaxremat.optimize` plans in.
  """
  step, args = example_step(name, None, small, batch_scale)
  base = jaxremat.measure(step, *args, runs=0, target=target)
  timed = [jax.jit(step)]  # the rows' compiled steps, timed together at the end
  reference = noise_envelope(step, *args)
  budgets_bytes = {b: jaxremat.parse_budget(b, base.peak_bytes) for b in budgets}
  label = ("small" if small else "default") + (f" batch x{batch_scale}" if batch_scale != 1 else "")
  common = {"example": name, "sizes": label, "target": target.name}
  rows = [
    {**common, "method": "no remat", **_figures(base, base, budgets_bytes)}
    | agreement(reference.expected, reference)
  ]
  for variant in variants_for(target):
    step, args = example_step(name, variant, small, batch_scale)
    m = jaxremat.measure(step, *args, runs=0, target=target)
    row = {**common, "method": f"jax.checkpoint {variant}", **_figures(m, base, budgets_bytes)}
    if target.local:
      timed.append(jax.jit(step))
      row |= agreement(timed[-1](*args), reference)
    rows.append(row)

  step, args = example_step(name, None, small, batch_scale)
  for budget in budgets:
    row = {**common, "method": "jaxremat auto", "budget": budget}
    row["budget_bytes"] = budgets_bytes[budget]
    fast = optimize_example(step, budget, time_limit_s, target, cache_dir, model=model)
    start = time.perf_counter()
    try:
      plan = fast.plan(*args)
    except (
      BudgetNotMetError,
      InfeasibleBudgetError,
      NoScheduleFoundError,
      VerificationError,
    ) as e:
      row.update(error=f"{type(e).__name__}: {e}", plan_s=time.perf_counter() - start)
      row["min_feasible_bytes"] = getattr(e, "min_feasible_bytes", None)
      row["best_measured_peak_bytes"] = getattr(e, "measured_peak_bytes", None)
      best = getattr(e, "plan", None)
      if best is not None:  # the plan handed out with BudgetNotMetError, on the plane too
        planned = best.schedule.stats["optimize"]
        row["best_plan"] = {
          **_figures(best.measurement, base, budgets_bytes),
          "predicted_peak_bytes": planned["predicted_peak_bytes"],
          # No plan holds less in the model; beyond_model: the budget is below that.
          "model_bound_bytes": planned["model_bound_bytes"],
          "beyond_model": planned["beyond_model"],
          "solver": best.schedule.solver,
          "n_plans": len(best.attempts),
          "attempts": [dataclasses.asdict(a) for a in best.attempts],
        }
      rows.append(row)
      continue
    m = plan.measurement
    if target.local:
      timed.append(plan.compiled)
    row.update(_figures(m, base, budgets_bytes))
    row.update(agreement(plan.compiled(*args), reference))
    stats = plan.schedule.stats
    row.update(
      plan_s=time.perf_counter() - start,
      solver=plan.schedule.solver,
      best_solver=stats.get("best_solver"),
      status=stats.get("status"),
      n_plans=len(plan.attempts),
      # Each plan compiled: who made it, with which fence, predicted against measured.
      attempts=[dataclasses.asdict(a) for a in plan.attempts],
      predicted_peak_bytes=stats["optimize"]["predicted_peak_bytes"],
      predicted_flops_ratio=stats["optimize"]["predicted_flops"]
      / stats["optimize"]["predicted_baseline_flops"],
      jaxremat_baseline_peak_bytes=plan.baseline_peak_bytes,
      jaxremat_measured_peak_bytes=plan.measured_peak_bytes,
      jaxremat_reports_met=plan.measured_peak_bytes <= plan.budget_bytes,
      xla_met=m.peak_bytes <= budgets_bytes[budget],
      n_recompute=stats.get("n_recompute"),
    )
    rows.append(row)
  if target.local:
    times_s = interleaved_times_s(timed, args, runs)
    for row, t in zip([r for r in rows if "error" not in r], times_s, strict=True):
      row.update(wall_time_s=t, time_ratio=t / times_s[0])
  for row in rows:
    _print_row(row)
  return rows


def add_device_peaks(rows: list[dict], time_limit_s, small, batch_scale, cache_dir) -> None:
  """Runs each row's method once in a fresh process (benchmarks/device_peak.py) and adds
  the device's peak (``memory_stats``) beside the compiler's."""

  def run(row: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.device_peak", row["example"], row["method"]]
    command += ["--time-limit", str(time_limit_s), "--batch-scale", str(batch_scale)]
    command += ["--small"] if small else []
    if "budget" in row:
      command += ["--budget", str(row["budget"]), "--cache-dir", cache_dir]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)

  rows = [row for row in rows if "error" not in row]
  # Each process's allocator is its own, so the processes may share the device.
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    runs = list(pool.map(run, rows))
  for row, done in zip(rows, runs, strict=True):
    if done.returncode:
      row["device_peak_error"] = done.stderr.strip().splitlines()[-1]
    else:
      got = json.loads(done.stdout.strip().splitlines()[-1])
      peak = got["device_peak_bytes"]
      row["device"] = got | {"device_over_xla": peak and peak / row["xla_peak_bytes"]}
    device = row.get("device", {})
    print(
      f"{row['example']:10} {row['method']} {row.get('budget', '')}: device peak "
      f"{(device.get('device_peak_bytes') or 0) / 2**20:.2f} MiB, compiler "
      f"{row['xla_peak_bytes'] / 2**20:.2f} MiB {row.get('device_peak_error', '')}",
      flush=True,
    )


def _print_row(row: dict) -> None:
  label = row["method"] + (f" @{row['budget']}" if "budget" in row else "")
  if "error" in row:
    best = row.get("best_plan")
    shown = (
      f" (best plan x{best['peak_ratio']:.3f}, FLOPs x{best['flops_ratio']:.3f})" if best else ""
    )
    print(f"{row['example']:10} {label:42} {row['error'][:110]}{shown}", flush=True)
    return
  meets = " ".join(f"{b}:{'y' if ok else 'n'}" for b, ok in row["meets"].items())
  predicted = (
    f" (predicted {row['predicted_peak_bytes'] / 2**20:.2f}, FLOPs"
    f" x{row['predicted_flops_ratio']:.3f})"
    if "predicted_peak_bytes" in row
    else ""
  )
  time_ratio = f"  time x{row['time_ratio']:.2f}" if "time_ratio" in row else ""
  errors = (
    f"  loss err {row['loss_rel_error']:.1e} grad err {row['grad_rel_norm_error']:.1e}"
    if "loss_rel_error" in row
    else ""
  )
  print(
    f"{row['example']:10} {label:42} {row['xla_peak_bytes'] / 2**20:9.2f} MiB{predicted} "
    f"x{row['peak_ratio']:.3f}  FLOPs x{row['flops_ratio']:.3f}{time_ratio}  meets {meets}"
    f"{errors}",
    flush=True,
  )


def checkpoint_wins(rows: list[dict]) -> list[str]:
  """Where a jax.checkpoint variant has a lower XLA peak than a jaxremat plan at equal or
  lower FLOPs, or meets a budget that jaxremat did not meet."""
  wins = []
  for v in rows:
    if not v["method"].startswith("jax.checkpoint"):
      continue
    for j in rows:
      if j["example"] != v["example"] or j["method"] != "jaxremat auto":
        continue
      if "error" in j and v["meets"][str(j["budget"])]:
        wins.append(f"{v['example']} @{j['budget']}: {v['method']} meets it, jaxremat did not")
      elif "error" not in j and (
        v["xla_peak_bytes"] < j["xla_peak_bytes"] and v["flops_ratio"] <= j["flops_ratio"]
      ):
        wins.append(
          f"{v['example']} @{j['budget']}: {v['method']} peak x{v['peak_ratio']:.3f} at FLOPs "
          f"x{v['flops_ratio']:.3f}, jaxremat x{j['peak_ratio']:.3f} at x{j['flops_ratio']:.3f}"
        )
  return wins


# -- solver table ---------------------------------------------------------------------


def _read_csv(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    return []
  with open(path) as f:
    return list(csv.DictReader(f))


def print_solver_table(rows: list[dict]) -> None:
  print(
    f"\n{'graph':28} {'auto TDI %':>10} {'s':>6} {'by':>12} {'best %':>8} {'from':>18}"
    f" {'moccasin %':>10} {'ref %':>7}"
  )
  for r in rows:
    print(
      f"{r['graph']:28} {r['auto_tdi_percent'][:6] or r['auto_status']:>10} "
      f"{float(r['auto_time_s']):6.1f} {r['auto_by']:>12} {r['best_tdi_percent'][:6]:>8} "
      f"{r['best_source']:>18} {r['moccasin_tdi_percent'][:6]:>10} {r['reference_tdi_percent']:>7}"
    )


def rerun_solvers(quick: bool, auto_time_limit_s: float) -> None:
  """Reruns `auto` of benchmarks/heuristics.py and the rows of benchmarks/solvers.py."""
  from benchmarks import heuristics, solvers

  graphs = sorted(p.stem for p in heuristics.GRAPHS.glob("*.json"))
  heuristic_rows = [
    {**r, "budget": float(r["budget"]), "tdi_percent": float(r["tdi_percent"])}
    for r in _read_csv(RESULTS / "heuristics.csv")
    if r.get("tdi_percent")
  ]
  heuristics.part_auto(graphs, auto_time_limit_s, 0, heuristic_rows)
  solvers.main(["--quick"] if quick else ["--no-large"])


def solver_table() -> list[dict]:
  """`auto` at 0.8 on every shared graph beside the best TDI any solver reached, and
  MOCCASIN against its reference, from the solver benchmarks' result files."""
  exact = {
    (r["graph"], r["m"]): r
    for r in _read_csv(RESULTS / "solvers.csv")
    if r["solver"] == "moccasin" and r["m"] == "0.8"
  }
  rows = []
  for r in _read_csv(RESULTS / "heuristics.auto.csv"):
    if not r["graph"].startswith("moccasin") and not r["graph"].endswith("_train"):
      continue  # inference graphs: no budget below their peak is feasible
    moccasin = exact.get((r["graph"], r["budget"]), {})
    rows.append(
      {
        "graph": r["graph"],
        "budget": float(r["budget"]),
        "auto_status": r["auto_status"],
        "auto_tdi_percent": r["auto_tdi_percent"],
        "auto_time_s": r["auto_time_s"],
        "auto_by": r["auto_best_solver"],
        "best_tdi_percent": r["best_tdi_percent"],
        "best_source": r["best_source"],
        "moccasin_tdi_percent": moccasin.get("tdi_percent", ""),
        "moccasin_time_to_best_s": moccasin.get("time_to_best_s", ""),
        "reference_tdi_percent": moccasin.get("ref_tdi_percent", ""),
        "reference_time_s": moccasin.get("ref_time_s", ""),
      }
    )
  return rows


# -- output ---------------------------------------------------------------------------


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
  fields = list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(
      {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()} for r in rows
    )


def plot(rows: list[dict], budgets, tag: str, target: jaxremat.Target) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(dict.fromkeys(r["example"] for r in rows))
  methods = ("no remat", *(f"jax.checkpoint {v}" for v in variants_for(target)))
  markers = dict(zip(methods, "os^vDPXh", strict=False))
  cols = min(3, len(names))
  fig, axes = plt.subplots(
    -(-len(names) // cols), cols, figsize=(5 * cols, 4 * -(-len(names) // cols)), squeeze=False
  )
  for ax, name in zip(axes.flat, names, strict=False):
    for r in rows:
      if r["example"] != name:
        continue
      if "error" in r:
        if "best_plan" in r:  # not met: the best plan, hollow
          best = r["best_plan"]
          label = f"jaxremat @{r['budget']} (not met)"
          ax.plot(best["flops_ratio"], best["peak_ratio"], "*", ms=13, mfc="none", label=label)
        continue
      if r["method"] == "jaxremat auto":
        ax.plot(r["flops_ratio"], r["peak_ratio"], "*", ms=13, label=f"jaxremat @{r['budget']}")
      else:
        ax.plot(r["flops_ratio"], r["peak_ratio"], markers[r["method"]], ms=8, label=r["method"])
    for b in budgets:
      ax.axhline(b, color="gray", ls="--", lw=0.8)
    ax.set_title(name)
    ax.set_xlabel("FLOPs / no remat (cost_analysis)")
    ax.set_ylabel("peak / no remat (memory_analysis)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  for ax in list(axes.flat)[len(names) :]:
    ax.set_visible(False)
  fig.suptitle(
    f"Training steps compiled for {target.name} ({target.device_kind}): peak against FLOPs "
    "as its compiler reports them (dashed: budgets)"
  )
  fig.tight_layout()
  fig.savefig(RESULTS / f"{tag}.png", dpi=110)
  if not target.local:
    return  # no wall times

  fig, ax = plt.subplots(figsize=(max(8, 2 * len(names)), 4))
  methods = list(
    dict.fromkeys(r["method"] + (f" @{r['budget']}" if "budget" in r else "") for r in rows)
  )
  width = 0.8 / len(methods)
  for i, method in enumerate(methods):
    values = [
      next(
        (
          r.get("time_ratio", np.nan)
          for r in rows
          if r["example"] == n
          and r["method"] + (f" @{r['budget']}" if "budget" in r else "") == method
        ),
        np.nan,
      )
      for n in names
    ]
    ax.bar(np.arange(len(names)) + i * width, values, width, label=method)
  ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
  ax.set_ylabel("median wall time / no remat")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.legend(fontsize=6, ncol=2)
  ax.set_title(f"Wall time on {target.device_kind} (load average {os.getloadavg()[0]:.1f})")
  fig.tight_layout()
  fig.savefig(RESULTS / f"{tag}_time.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a subset that runs in minutes")
  parser.add_argument("--examples", help="comma-separated (default: all, or the quick subset)")
  parser.add_argument("--budgets", help="comma-separated fractions (default 0.9,0.7,0.5)")
  parser.add_argument("--time-limit", type=float, help="seconds per solve (default 30; quick 10)")
  parser.add_argument("--runs", type=int, help="timed calls per step (default 5; quick 3)")
  parser.add_argument("--small", action="store_true", help="the examples' smallest sizes")
  parser.add_argument(
    "--batch-scale",
    type=int,
    default=1,
    help="multiply each example's batch (on TPU, to put the temporaries past on-chip memory)",
  )
  parser.add_argument(
    "--rerun-solvers", action="store_true", help="rerun the solver benchmarks' parts first"
  )
  parser.add_argument("--auto-time-limit", type=float, default=60.0, help="with --rerun-solvers")
  parser.add_argument(
    "--target", help="compile for this device (jaxremat.get_target, e.g. tpu-v5e, h100)"
  )
  parser.add_argument(
    "--model",
    default="auto",
    choices=("auto", "rules", "compiler"),
    help="the memory model jaxremat plans in (jaxremat.trace_program)",
  )
  parser.add_argument(
    "--device-peaks",
    action="store_true",
    help="on this machine's GPU or TPU, also run each method alone in a fresh process and "
    "record the device's peak_bytes_in_use (benchmarks/device_peak.py)",
  )
  args = parser.parse_args(argv)
  # Before any array exists: a GPU target may need JAX started a particular way.
  target = jaxremat.get_target(args.target)
  names = (
    args.examples.split(",")
    if args.examples
    else QUICK_EXAMPLES
    if args.quick
    else examples.EXAMPLES
  )
  budgets = (
    tuple(map(float, args.budgets.split(",")))
    if args.budgets
    else (QUICK_BUDGETS if args.quick else BUDGETS)
  )
  time_limit_s = args.time_limit or (10.0 if args.quick else 30.0)
  runs = args.runs or (3 if args.quick else 5)
  RESULTS.mkdir(parents=True, exist_ok=True)
  # A run over chosen examples is saved beside the full one, not over it.
  tag = "e2e_quick" if args.quick else f"e2e_{'_'.join(names)}" if args.examples else "e2e"
  if target.platform != "cpu":  # named or this machine's accelerator ("gpu:NVIDIA H200")
    tag += "_" + re.sub(r"[^A-Za-z0-9.-]+", "_", target.name)
  if args.batch_scale != 1:
    tag += f"_batchx{args.batch_scale}"
  if args.model != "auto":
    tag += f"_{args.model}"
  if args.device_peaks and not (target.local and target.platform in ("gpu", "tpu")):
    parser.error(f"--device-peaks needs a GPU or TPU here; the target is {target.name!r}.")
  cache_dir = tempfile.mkdtemp(prefix="jaxremat-e2e-") if args.device_peaks else None

  start, loads = time.perf_counter(), [os.getloadavg()[0]]
  if args.rerun_solvers:
    rerun_solvers(args.quick, args.auto_time_limit)
  solver_rows = [] if args.target else solver_table()  # the graphs have no target
  if solver_rows:
    _write_csv(RESULTS / "e2e_solvers.csv", solver_rows)
    print_solver_table(solver_rows)

  rows: list[dict] = []
  for name in names:
    found = run_example(
      name, budgets, time_limit_s, runs, args.small, target, args.batch_scale, cache_dir, args.model
    )
    if args.device_peaks:
      add_device_peaks(found, time_limit_s, args.small, args.batch_scale, cache_dir)
    rows += found
    loads.append(os.getloadavg()[0])
    # Saved after every example, so that an interrupted run keeps what it measured.
    unmet = [r for r in rows if r.get("jaxremat_reports_met") and not r.get("xla_met")]
    meta = {
      "command": "python -m benchmarks.e2e " + " ".join(sys.argv[1:] if argv is None else argv),
      "target": target.name,
      "backend": target.platform,
      "device": target.device_kind,
      "deviceless": not target.local,
      "jax": jax.__version__,
      "budgets": budgets,
      "time_limit_s": time_limit_s,
      "model": args.model,
      "runs": runs,
      "load_avg_1min": loads,
      "total_s": time.perf_counter() - start,
      "examples_done": list(dict.fromkeys(r["example"] for r in rows)),
      "jaxremat_met_but_xla_not": len(unmet),
      "checkpoint_wins": checkpoint_wins(rows),
    }
    (RESULTS / f"{tag}.json").write_text(
      json.dumps({"meta": meta, "rows": rows, "solvers": solver_rows}, indent=1, default=str)
    )
    _write_csv(RESULTS / f"{tag}.csv", rows)
    plot(rows, budgets, tag, target)
  for line in meta["checkpoint_wins"]:
    print(f"jax.checkpoint does better: {line}")
  for r in unmet:
    print(
      f"BUG: jaxremat reported {r['example']} @{r['budget']} met; XLA measured "
      f"{r['xla_peak_bytes']} > {r['budget_bytes']} bytes"
    )
  print(f"\n{meta['total_s']:.0f} s, load average {loads}; results in {RESULTS}/{tag}.*")


if __name__ == "__main__":
  main()
