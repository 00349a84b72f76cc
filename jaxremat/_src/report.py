"""`Report`: the original and the optimized step side by side, as XLA measures them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from jaxremat._src.measure import Measurement, measure
from jaxremat._src.planner import Plan
from jaxremat._src.signature import FlatStep
from jaxremat._src.verify import collectives_as_planned, planned_sent_bytes, unplanned_sent_bytes


@dataclasses.dataclass(frozen=True)
class Report:
  """The original and the optimized step side by side, as XLA measures them."""

  plan: Plan
  original: Measurement
  optimized: Measurement

  def recomputed(self) -> list[tuple[str, str, int]]:
    """``(source, primitive, count)`` of recomputed nodes, most recomputations first."""
    graph = self.plan.program.graph
    counts = collections.Counter(self.plan.schedule.computes)
    grouped: collections.Counter = collections.Counter()
    for v, n in counts.items():
      if n > 1:
        attrs = graph.nodes[v].attrs
        grouped[(attrs.get("source", "?"), attrs.get("primitive", graph.nodes[v].name))] += n - 1
    return [(src, prim, n) for (src, prim), n in grouped.most_common()]

  def __str__(self) -> str:
    p, s = self.plan, self.plan.schedule.stats
    model = s.get("optimize", {})
    predicted = model.get("predicted_peak_bytes", s["peak_bytes"])
    predicted_baseline = model.get("predicted_baseline_peak_bytes", s["baseline_peak_bytes"])
    mib = 2.0**20
    orig, opt = self.original, self.optimized
    met = "met" if opt.peak_bytes <= p.budget_bytes else "NOT met"

    def ratio(a, b):
      return f"x{a / b:.3f}" if a is not None and b else "n/a"

    graph = p.program.graph

    def sent(computes) -> int:  # what the collectives of these computations send, per device
      return sum(graph.nodes[v].attrs.get("collective_bytes", 0) for v in computes)

    rows = [
      ("", "original", "optimized", "ratio"),
      (
        "peak, model",
        f"{predicted_baseline / mib:.1f} MiB",
        f"{predicted / mib:.1f} MiB",
        ratio(predicted, predicted_baseline),
      ),
      (
        "peak, XLA",
        f"{orig.peak_bytes / mib:.1f} MiB",
        f"{opt.peak_bytes / mib:.1f} MiB",
        ratio(opt.peak_bytes, orig.peak_bytes),
      ),
      (
        "duration, model",
        f"{s['baseline_duration']:.3g}",
        f"{s['duration']:.3g}",
        ratio(s["duration"], s["baseline_duration"]),
      ),
      (
        "FLOPs, model",
        f"{model.get('predicted_baseline_flops', 0):.3g}",
        f"{model.get('predicted_flops', 0):.3g}",
        ratio(model.get("predicted_flops"), model.get("predicted_baseline_flops")),
      ),
      (
        "FLOPs, XLA",
        f"{orig.flops or 0:.3g}",
        f"{opt.flops or 0:.3g}",
        ratio(opt.flops, orig.flops),
      ),
      *(
        [
          (
            "sent, model",
            f"{sent(graph.order) / mib:.1f} MiB",
            f"{sent(p.schedule.computes) / mib:.1f} MiB",
            ratio(sent(p.schedule.computes), sent(graph.order)),
          ),
          (
            "sent, XLA",
            f"{orig.sent_bytes / mib:.1f} MiB",
            f"{opt.sent_bytes / mib:.1f} MiB",
            ratio(opt.sent_bytes, orig.sent_bytes),
          ),
        ]
        if orig.sent_bytes or opt.sent_bytes
        else []
      ),
      (
        "wall time",
        _ms(orig.wall_time_s),
        _ms(opt.wall_time_s),
        ratio(opt.wall_time_s, orig.wall_time_s),
      ),
    ]
    lines = [
      f"jaxremat: {p.program.graph.name} ({p.program.graph.n} nodes) for {opt.target} "
      f"({opt.device_kind})" + (f", per device of {opt.partitions}" if opt.partitions > 1 else ""),
      f"budget {p.budget_bytes / mib:.1f} MiB: {met} (XLA measured {opt.peak_bytes / mib:.1f} MiB)",
      f"solver {self.plan.schedule.solver}: {s.get('status')} in {s.get('solve_time_s', 0):.2f} s"
      + (" (plan from cache)" if p.from_cache else f", {len(p.attempts)} plan(s)"),
      "",
    ]
    lines += [f"{a:<16}{b:>14}{c:>14}{d:>9}" for a, b, c, d in rows]
    unplanned = unplanned_sent_bytes(
      orig.sent_bytes, opt.sent_bytes, planned_sent_bytes(p.program, p.schedule)
    )
    if not collectives_as_planned(unplanned, orig.sent_bytes):
      lines.append(
        f"XLA sends {unplanned / mib:.1f} MiB per device that neither the step nor the "
        "plan's recomputations need: the partitioner split the emitted program otherwise."
      )
    if p.program.loops:
      lines += ["", "loops that store less for the backward pass:"]
      lines += [f"  {loop.line}" for loop in p.program.loops]
    recomputed = self.recomputed()
    lines += [
      "",
      f"recomputed: {s.get('n_recompute', 0)} node computations"
      + (", by source:" if recomputed else ""),
    ]
    lines += [f"  {n:4d} x {prim:<18} {src}" for src, prim, n in recomputed[:20]]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
  return "not run" if seconds is None else f"{seconds * 1e3:.2f} ms"


def make_report(
  plan: Plan, fn: Callable[..., Any], args: tuple, kwargs: dict, *, runs: int = 5
) -> Report:
  """Measures the original ``fn`` and ``plan``'s step on these arguments, with the step's
  donation (donated arguments are copied before each call), for the plan's target; a
  target without devices here is compiled for, not run."""
  signature = plan.compiled.signature
  leaves = signature.dynamic_leaves(args, kwargs)
  target = plan.target
  options = dict(
    runs=runs if target.local else 0, donate_argnums=signature.donated_leaves, target=target
  )
  original = measure(FlatStep(fn, signature), *leaves, **options)
  optimized = measure(plan.compiled.jitted, *leaves, **options)
  return Report(plan, original, optimized)
