"""The hand-written model of what XLA fuses and what extra memory it allocates.

Which equations XLA computes inside the fusion of their readers and never materializes
(ARCHITECTURE.md fact 2), grouped into the nodes of the graph (`group_equations`), and
the memory XLA allocates that the jaxpr does not show: scratch copies of operands
(`workspace_bytes`), buffers made at the program start (`pool_gradient_buffers`) and
what loop bodies keep (`internal_bytes`). With the compiler's model (`hlo_model`) its
optimized program answers instead (`_group_as_compiled`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxremat._src import compat, hlo_model

# -- grouping equations into nodes ---------------------------------------------------------

# Values XLA computes inside the fusion of their consumer (ARCHITECTURE.md fact 2).
FUSIBLE_PRIMITIVES = frozenset(
  {
    "abs",
    "acos",
    "acosh",
    "add",
    "add_any",
    "and",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "bitcast_convert_type",
    "broadcast_in_dim",
    "cbrt",
    "ceil",
    "clamp",
    "convert_element_type",
    "copy",
    "copy_p",
    "cos",
    "cosh",
    "div",
    "eq",
    "erf",
    "erf_inv",
    "erfc",
    "exp",
    "exp2",
    "expand_dims",
    "expm1",
    "floor",
    "ge",
    "gt",
    "imag",
    "integer_pow",
    "iota",
    "is_finite",
    "le",
    "lgamma",
    "digamma",
    "log",
    "log1p",
    "logistic",
    "lt",
    "max",
    "min",
    "mul",
    "ne",
    "neg",
    "nextafter",
    "not",
    "or",
    "pow",
    "real",
    "reduce_precision",
    "rem",
    "round",
    "rsqrt",
    "select_n",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "square",
    "squeeze",
    "stop_gradient",
    "sub",
    "tan",
    "tanh",
    "xor",
    "reshape",
    "pad",
    "slice",
    "concatenate",
    "rev",
    "transpose",
    "dynamic_slice",
    "population_count",
    "clz",
    "conj",
    *compat.NEW_ELEMENTWISE_PRIMITIVES,
  }
)
# Consumers whose fusion can absorb fusible producers (loop and input fusion); on XLA:CPU a
# reduction takes no duplicated ones (`BackendFacts.reductions_duplicate_producers`).
FUSING_CONSUMERS = FUSIBLE_PRIMITIVES | frozenset(
  {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
    "dynamic_update_slice",
    "select_and_scatter_add",
  }
)
HIGHER_ORDER_PRIMITIVES = frozenset({"scan", "while", "cond"})
# The reductions XLA:CPU runs as YNNPACK fusions (``__ynn_fusion`` in its optimized HLO),
# when they reduce floating-point values; integer sums are loop fusions.
YNN_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})


# Equations whose recomputation costs real time, and the HLO instruction each becomes.
# Elementwise work is left out: XLA fuses and duplicates it on its own (fact 2).
KERNEL_PRIMITIVES: Mapping[str, str] = {
  "dot_general": "dot",
  "conv_general_dilated": "convolution",
  "fft": "fft",
  "sort": "sort",
}

# Elementwise operations XLA will not duplicate into several consumers (too costly).
EXPENSIVE_PRIMITIVES = frozenset(
  {
    "div",
    "rem",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "integer_pow",
  }
)


def _duplicable(eqn: Any) -> bool:
  """Whether XLA would recompute ``eqn`` inside each of several consumer fusions.

  Not expensive ones, and not broadcasts of whole arrays: XLA:CPU's dot fusions
  (XNNPACK) take those as materialized operands (e.g. softmax's 1/sum).
  """
  name = eqn.primitive.name
  if name in EXPENSIVE_PRIMITIVES:
    return False
  if name == "broadcast_in_dim":
    return all(math.prod(getattr(v.aval, "shape", ())) <= 1 for v in eqn.invars)
  return True


def _at_most_unary(eqn: Any, made_by: dict[Any, Any]) -> bool:
  """Whether at most one operand of ``eqn`` is large: XLA duplicates such a producer freely.

  XLA's rule (``EffectivelyAtMostUnary`` in its instruction fusion): duplicating a producer
  that reads one large array adds no memory traffic, so it may be fused into readers that
  are themselves duplicated, in chains. An operand is small when it has fewer dimensions
  of size > 1 than the output, or is a broadcast or an iota.
  """

  def true_ndim(v: Any) -> int:
    return sum(d > 1 for d in getattr(v.aval, "shape", ()))

  def large(v: Any) -> bool:
    if isinstance(v, compat.Literal):
      return False
    producer = made_by.get(v)
    if producer is not None and producer.primitive.name in ("broadcast_in_dim", "iota"):
      return False
    return true_ndim(v) >= out_ndim

  out_ndim = max(true_ndim(v) for v in eqn.outvars)
  return sum(map(large, eqn.invars)) <= 1


def _ynn_reduction(eqn: Any) -> bool:
  """Whether XLA:CPU runs ``eqn`` as a YNNPACK reduction (see `YNN_REDUCTIONS`)."""
  return eqn.primitive.name in YNN_REDUCTIONS and jax.numpy.issubdtype(
    eqn.invars[0].aval.dtype, np.floating
  )


def group_equations(
  jaxpr: Any,
  fold: bool,
  reductions_duplicate: bool = True,
  compiled: hlo_model.CompiledValues | None = None,
) -> tuple[list[list[int]], set[int], dict[Any, int]]:
  """Groups equation indices into nodes; each group's last equation is its root.

  Folding runs from the end: a fusible, effect-free equation whose outputs are all
  read by equations of one group, each able to fuse it, and none a function output,
  joins that group. A cheap one read by several such groups stays a group of its own
  that XLA duplicates into each reader (returned in the second set: its value is
  never materialized); into readers that are duplicated themselves only when it reads
  one large array (`_at_most_unary`). Every edge then runs from an earlier root to a
  later one.
  Unless ``reductions_duplicate``, a value read by a reduction (one XLA:CPU runs as a
  YNNPACK fusion) and by another group is materialized, not duplicated.

  No group with a product in it (`KERNEL_PRIMITIVES`) is duplicated, even where XLA
  fuses it with its readers (a dot XLA:CPU fuses with all of them, slices XLA sinks into
  a dot): the emitted program computes it on its own and keeps its output while a plan
  keeps it. Given no bytes, a plan keeping a transformer's fused QKV product to the
  backward pass was counted without its 4.5 MiB per layer (a ViT's `dots_saveable` plan
  on XLA:CPU: 109.64 MiB where XLA measured 154.69; with them, 145.63), and the step's
  own peak moved by under 0.1% on every example.

  Returns the groups, the duplicated groups and the values XLA keeps at a larger size
  than their aval (`_materialized_divisors`: var -> bytes).

  ``compiled``, the values the target compiler materializes and their sizes
  (`hlo_model`), replaces the rules: any other equation joins its readers' group, or is
  duplicated into each of several.
  """
  if fold and compiled is not None:
    groups, duplicated, materialized = _group_as_compiled(jaxpr, compiled)
  else:
    groups, duplicated, materialized = _group_by_rules(jaxpr, fold, reductions_duplicate)
  return groups, _without_products(jaxpr, groups, duplicated), materialized


def _group_by_rules(
  jaxpr: Any, fold: bool, reductions_duplicate: bool
) -> tuple[list[list[int]], set[int], dict[Any, int]]:
  """`group_equations` by the rules (its folding, described there)."""
  eqns = jaxpr.eqns
  readers: dict[Any, list[int]] = {}
  for k, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, compat.Var) and not isinstance(v, compat.Literal):
        readers.setdefault(v, []).append(k)
  outvars = {v for v in jaxpr.outvars if isinstance(v, compat.Var)}
  made_by = {v: e for e in eqns for v in e.outvars}
  group_of = [-1] * len(eqns)
  groups: list[list[int]] = []
  duplicated: set[int] = set()
  reductions: set[int] = set()  # groups no duplicated value is fused into
  for k in range(len(eqns) - 1, -1, -1):
    eqn = eqns[k]
    target = None
    dup = False
    if fold and eqn.primitive.name in FUSIBLE_PRIMITIVES and not eqn.effects:
      outs = [v for v in eqn.outvars if not isinstance(v, compat.DropVar)]
      rs = [r for v in outs for r in readers.get(v, ())]
      if rs and not any(v in outvars for v in outs):
        gs = {group_of[r] for r in rs}
        fusing = all(eqns[r].primitive.name in FUSING_CONSUMERS for r in rs)
        if gs & reductions:
          fusing = len(gs) == 1  # the reduction's fusion takes it in only as its sole reader
        if len(gs) == 1 and fusing:
          target = gs.pop()
        elif fusing and _duplicable(eqn) and (not gs & duplicated or _at_most_unary(eqn, made_by)):
          dup = True
    if target is None:
      group_of[k] = len(groups)
      if dup:
        duplicated.add(len(groups))
      if not reductions_duplicate and _ynn_reduction(eqn):
        reductions.add(len(groups))
      groups.append([k])
    else:
      group_of[k] = target
      groups[target].append(k)
  order = sorted(range(len(groups)), key=lambda g: max(groups[g]))
  out = [sorted(groups[g]) for g in order]
  dup_roots = {max(groups[g]) for g in duplicated}
  if fold:
    out = _merge_in_place(jaxpr, out, readers, outvars, dup_roots)
  dup = {i for i, g in enumerate(out) if g[-1] in dup_roots}
  materialized: dict[Any, int] = {}
  if fold:
    dup |= _input_free(jaxpr, out, outvars)
    epilogues = _dot_epilogues(jaxpr, out, readers, outvars, dup)
    materialized = _materialized_divisors(jaxpr, out, epilogues)
  return out, dup, materialized


def _without_products(jaxpr: Any, groups: list[list[int]], duplicated: set[int]) -> set[int]:
  """``duplicated`` less the groups with a product in them (`group_equations`)."""
  eqns = jaxpr.eqns
  return {
    g for g in duplicated if not any(eqns[k].primitive.name in KERNEL_PRIMITIVES for k in groups[g])
  }


def _group_as_compiled(
  jaxpr: Any, compiled: hlo_model.CompiledValues
) -> tuple[list[list[int]], set[int], dict[Any, int]]:
  """`group_equations` with the compiler's answer to which equations keep a buffer, and
  how large each is (split over an equation's outputs in proportion to their avals)."""
  kept = compiled.kept
  eqns = jaxpr.eqns
  readers: dict[Any, list[int]] = {}
  for k, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, compat.Var) and not isinstance(v, compat.Literal):
        readers.setdefault(v, []).append(k)
  outvars = {v for v in jaxpr.outvars if isinstance(v, compat.Var)}
  group_of = [-1] * len(eqns)
  groups: list[list[int]] = []
  duplicated: set[int] = set()
  for k in range(len(eqns) - 1, -1, -1):
    eqn = eqns[k]
    outs = [v for v in eqn.outvars if not isinstance(v, compat.DropVar)]
    gs = {group_of[r] for v in outs for r in readers.get(v, ())}
    folds = k not in kept and not eqn.effects and gs and not any(v in outvars for v in outs)
    if folds and len(gs) == 1:
      group_of[k] = gs.pop()
      groups[group_of[k]].append(k)
      continue
    group_of[k] = len(groups)
    if folds:
      duplicated.add(len(groups))
    groups.append([k])
  order = sorted(range(len(groups)), key=lambda g: max(groups[g]))
  dup_roots = {max(groups[g]) for g in duplicated}
  out = [sorted(groups[g]) for g in order]
  materialized: dict[Any, int] = {}
  sizes = dict(compiled.bytes)
  for k in (
    k for g in duplicated for k in groups[g] if eqns[k].primitive.name in KERNEL_PRIMITIVES
  ):
    # A product the compiler keeps no buffer of (`_without_products` keeps it a node, to
    # pay for its work once) is in the buffer of the one kept product that shares an
    # operand with it, has room for it beside its own value, and is read by all its kept
    # readers: XLA:GPU merges products of one operand into one (the gate and the experts
    # of a mixture-of-experts layer: f32[4096,2052]; an unrolled GRU's input products of
    # all its steps). Each holds its own share of it, so that a plan that makes one again
    # makes a buffer of its own size. A reader that one multi-output instruction computes
    # with a reader of the buffer reads it too.
    reading = _kept_readers(eqns, readers, kept, k)
    own = _output_bytes(eqns[k])
    (holder, *others) = [
      j
      for j in sizes
      if reading
      and eqns[j].primitive.name in KERNEL_PRIMITIVES
      and _operands(eqns[j]) & _operands(eqns[k])
      and sizes[j] >= _output_bytes(eqns[j]) + own
      and reading
      <= {s for r in compiled.read_for.get(j, ()) for s in compiled.made_with.get(r, {r})}
    ] or [None]
    if holder is not None and not others:
      sizes[holder] -= own
  for k, size in sizes.items():
    outs = [v for v in eqns[k].outvars if not isinstance(v, compat.DropVar)]
    total = sum(compat.aval_bytes(v.aval) for v in outs)
    for v in outs:
      materialized[v] = size * compat.aval_bytes(v.aval) // total if total else 0
  return out, {i for i, g in enumerate(out) if g[-1] in dup_roots}, materialized


def _operands(eqn: Any) -> set[Any]:
  return {v for v in eqn.invars if not isinstance(v, compat.Literal)}


def _output_bytes(eqn: Any) -> int:
  return sum(compat.aval_bytes(v.aval) for v in eqn.outvars)


def _kept_readers(
  eqns: Any, readers: dict[Any, list[int]], kept: frozenset[int], k: int
) -> set[int]:
  """The kept equations that read equation ``k``'s outputs, directly or through
  equations the compiler keeps no buffer of."""
  found: set[int] = set()
  todo, seen = [k], {k}
  while todo:
    for r in (r for v in eqns[todo.pop()].outvars for r in readers.get(v, ())):
      if r in kept:
        found.add(r)
      elif r not in seen:
        seen.add(r)
        todo.append(r)
  return found


# Roots whose output XLA may write into the buffer of a same-shape operand that dies there.
_SHAPE_CHANGING = frozenset(
  {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "pad",
    "slice",
    "concatenate",
    "rev",
    "transpose",
    "dynamic_slice",
    "iota",
  }
)


def _merge_in_place(
  jaxpr: Any,
  groups: list[list[int]],
  readers: dict[Any, list[int]],
  outvars: set[Any],
  dup_roots: set[int],
) -> list[list[int]]:
  """Merges an elementwise group into the group whose only value it consumes in place.

  XLA's buffer assignment lets an elementwise fusion write into the buffer of a
  same-shape operand whose last use it is (e.g. bias-add + tanh into the dot's output).
  When group p exports exactly one value x, read only by group g, and g's root is
  elementwise with x's shape and dtype, charging both would overstate the peak: the
  two groups become one node that keeps only g's output. No other path runs from p to
  g, so the merge keeps the graph acyclic.
  """
  eqns = jaxpr.eqns
  group_of = {k: gi for gi, g in enumerate(groups) for k in g}
  producer = {v: group_of[k] for k, e in enumerate(eqns) for v in e.outvars}

  def exports(g: list[int]) -> list[Any]:
    members = set(g)
    out = []
    for k in g:
      for v in eqns[k].outvars:
        if isinstance(v, compat.DropVar):
          continue
        if v in outvars or any(r not in members for r in readers.get(v, ())):
          out.append(v)
    return out

  merged_into: dict[int, int] = {}  # group index -> the group it joined
  members = [list(g) for g in groups]
  for gi, g in enumerate(groups):
    root = eqns[g[-1]]
    if g[-1] in dup_roots:
      continue
    if root.primitive.name not in FUSIBLE_PRIMITIVES or root.primitive.name in _SHAPE_CHANGING:
      continue
    if root.effects or len(root.outvars) != 1:
      continue
    out_aval = root.outvars[0].aval
    operands = [v for k in g for v in eqns[k].invars]
    for v in operands:
      if isinstance(v, compat.Literal) or v not in producer:
        continue
      p = producer[v]
      while p in merged_into:
        p = merged_into[p]
      if p == gi or members[p] is None or members[p][-1] in dup_roots:
        continue
      aval = v.aval
      if (
        getattr(aval, "shape", None) != getattr(out_aval, "shape", None)
        or aval.dtype != out_aval.dtype
      ):
        continue
      if exports(members[p]) != [v] or v in outvars:
        continue
      if any(group_of[r] != gi for r in readers.get(v, ())):
        continue
      if any(
        eqns[k].effects or eqns[k].primitive.name in HIGHER_ORDER_PRIMITIVES for k in members[p]
      ):
        continue  # scan/while/cond stay nodes of their own
      members[gi] = sorted(members[p] + members[gi])
      members[p] = None
      merged_into[p] = gi
      break
  return [m for m in members if m is not None]


def _input_free(jaxpr: Any, groups: list[list[int]], outvars: set[Any]) -> set[int]:
  """Fusible groups that depend on no function input (iota, broadcast literals, masks).

  Such a value is a constant of the program; XLA does not keep it but computes it
  inside each fusion that reads it (a causal mask from two iotas and a compare), so
  it is treated like a duplicated value. Groups come in root order, so a group's
  producers are decided before it.
  """
  group_of = {k: gi for gi, g in enumerate(groups) for k in g}
  producer = {v: group_of[k] for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
  found: set[int] = set()
  for gi, g in enumerate(groups):
    eqns = [jaxpr.eqns[k] for k in g]
    if any(v in outvars for e in eqns for v in e.outvars):
      continue
    if all(
      e.primitive.name in FUSIBLE_PRIMITIVES
      and not e.effects
      and all(
        isinstance(v, compat.Literal) or producer.get(v) == gi or producer.get(v) in found
        for v in e.invars
      )
      for e in eqns
    ):
      found.add(gi)
  return found


def _dot_epilogues(
  jaxpr: Any,
  groups: list[list[int]],
  readers: dict[Any, list[int]],
  outvars: set[Any],
  duplicated: set[int],
) -> set[int]:
  """Groups whose root is a dot XLA:CPU fuses with all of its readers (an epilogue).

  XLA:CPU's dot fusions (XNNPACK, ``__ynn_fusion`` in the optimized HLO) absorb the
  elementwise and reduce equations that consume the dot's output, so the output is
  never materialized, e.g. the softmax gradient ``p * (g - sum(g * p))`` around the
  ``g @ v^T`` of attention. This holds when every reader of the dot's only exported
  value is such an equation and all their other operands are ready when the dot runs
  (made before it or by another reader): a reader that waits for a later value (the
  GELU gradient reading a forward dot output) is a separate fusion, and the dot's output
  stays. The readers must also run right after the dot, up to groups that could run
  before it (an optimizer update of a weight gradient, late in a training step, does
  not). Which divisors XLA keeps follows from them (`_materialized_divisors`); the dots
  keep their bytes in the graph (`group_equations`).
  """
  eqns = jaxpr.eqns
  group_of = {k: gi for gi, g in enumerate(groups) for k in g}
  producer = {v: group_of[k] for k, e in enumerate(eqns) for v in e.outvars}
  found = set()
  for gi, g in enumerate(groups):
    root = eqns[g[-1]]
    if gi in duplicated or root.primitive.name != "dot_general" or len(root.outvars) != 1:
      continue
    out = root.outvars[0]
    if out in outvars or not readers.get(out):
      continue
    members = set(g)
    exported = [
      v
      for k in g
      for v in eqns[k].outvars
      if v in outvars or any(r not in members for r in readers.get(v, ()))
    ]
    if exported != [out]:
      continue
    # The cluster: the readers and any later fusible group they read (e.g. the negated
    # row sum); everything else they read must be made before the dot.
    cluster = {group_of[r] for r in readers[out]}
    todo, ok = list(cluster), True
    while todo and ok:
      r = todo.pop()
      for k in groups[r]:
        e = eqns[k]
        if e.effects or e.primitive.name not in FUSING_CONSUMERS:
          ok = False
        for v in e.invars:
          if isinstance(v, compat.Literal) or v not in producer:
            continue  # literals and graph inputs are ready
          q = producer[v]
          if q > gi and q not in cluster:
            cluster.add(q)
            todo.append(q)
    # A duplicated value in the cluster is computed inside the fusion of each of its
    # readers: they must all be in the cluster too.
    for r in cluster & duplicated:
      made = [v for k in groups[r] for v in eqns[k].outvars]
      if any(group_of[k] not in cluster for v in made for k in readers.get(v, ())):
        ok = False
    # The groups between the dot and its last reader must be able to run before the dot
    # (read nothing made after it), as XLA's scheduler may order them.
    before = set()
    for j in range(gi + 1, max(cluster) if ok else gi):
      if j in cluster:
        continue
      made_after = (
        producer[v]
        for k in groups[j]
        for v in eqns[k].invars
        if not isinstance(v, compat.Literal) and v in producer
      )
      if any(q >= gi and q not in before and q != j for q in made_after):
        ok = False
        break
      before.add(j)
    if ok:
      found.add(gi)
  return found


def _materialized_divisors(
  jaxpr: Any, groups: list[list[int]], epilogue_dots: set[int]
) -> dict[Any, int]:
  """Divisors XLA:CPU keeps broadcast to the full shape: var -> bytes of the broadcast.

  XLA's algebraic simplifier turns ``x / broadcast(s)`` into ``x * broadcast(1 / s)``
  and CSE makes the forward and backward divisions by ``s`` (softmax and its gradient)
  share one broadcast. A dot fusion (see `_dot_epilogues`) does not duplicate a producer
  that has other users, so when one of the divisions is in a dot's epilogue the
  broadcast reciprocal is materialized at the quotient's shape and lives as long as
  ``s`` does (2 MiB per attention layer of examples/gpt.py, where the jaxpr keeps only
  the ``[B, H, T, 1]`` sum). A divisor is "broadcast" here when the division broadcasts
  it implicitly (size-1 dimensions), as ``jax.nn.softmax`` emits it.
  """
  eqns = jaxpr.eqns
  group_of = {k: gi for gi, g in enumerate(groups) for k in g}
  dot_out = {eqns[groups[g][-1]].outvars[0] for g in epilogue_dots}
  divisions: dict[Any, list[Any]] = {}
  for k, e in enumerate(eqns):
    if e.primitive.name != "div" or isinstance(e.invars[1], compat.Literal):
      continue
    d, out = e.invars[1], e.outvars[0]
    if (
      getattr(d.aval, "shape", ()) != getattr(out.aval, "shape", ())
      and d.aval.ndim == out.aval.ndim
    ):
      divisions.setdefault(d, []).append((k, e))
  found = {}
  for d, uses in divisions.items():
    in_epilogue = any(e.invars[0] in dot_out for _, e in uses)
    if in_epilogue and len({group_of[k] for k, _ in uses}) >= 2:
      full = max(compat.aval_bytes(e.outvars[0].aval) for _, e in uses)
      found[d] = max(full, compat.aval_bytes(d.aval))
  return found


# -- memory XLA allocates that the jaxpr does not show ------------------------------------


def workspace_bytes(eqn: Any) -> int:
  """Scratch bytes XLA allocates for ``eqn`` beyond its outputs (ARCHITECTURE.md fact 2).

  XLA:CPU runs batched dots and convolutions in one canonical layout (batch dims first,
  features last); layout assignment inserts a transposed copy of every operand (and
  output) in another layout. Gradients of dots and convolutions are the usual case.
  The scratch lives only while the equation runs, so it is a node attribute, not part
  of ``mem`` (which stays live as long as the output: charging it there overstated
  the U-Net and ResNet peaks by 20-60%).
  """
  name = eqn.primitive.name
  if name == "dot_general":
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    total = 0
    nb_l, nb_r = len(lb), len(rb)
    if tuple(lb) != tuple(range(nb_l)) or tuple(lc) != tuple(
      range(lhs.aval.ndim - len(lc), lhs.aval.ndim)
    ):
      total += compat.aval_bytes(lhs.aval)
    if tuple(rb) != tuple(range(nb_r)) or tuple(rc) != tuple(range(nb_r, nb_r + len(rc))):
      total += compat.aval_bytes(rhs.aval)
    return total
  if name == "conv_general_dilated":
    # One transposed copy is live at a time; the largest bounds the scratch.
    dn = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    nd = lhs.aval.ndim
    spatial = tuple(range(1, nd - 1))
    copies = [0]
    if tuple(dn.lhs_spec) != (0, nd - 1, *spatial):
      copies.append(compat.aval_bytes(lhs.aval))
    if tuple(dn.rhs_spec) != (nd - 1, nd - 2, *range(nd - 2)):
      copies.append(compat.aval_bytes(rhs.aval))
    if tuple(dn.out_spec) != (0, nd - 1, *spatial):
      copies.append(compat.aval_bytes(eqn.outvars[0].aval))
    return max(copies)
  return 0


def pool_gradient_buffers(
  jaxpr: Any, groups: list[list[int]]
) -> tuple[dict[int, int], dict[int, int], set[int]]:
  """Buffers XLA:CPU makes at the program start for the gradients of max pools.

  XLA:CPU lowers ``select_and_scatter_add`` (a max pool's gradient) to a variadic
  reduce-window, run with the forward pool, that carries the argmax position (one s32
  iota of the pooled operand's shape per dimension as operands), and a scatter that
  adds into a zero-filled buffer of the operand's shape in place. The iotas and the
  zeros have no non-constant operands, so XLA's scheduler makes them at the start of
  the program: the iotas live until the forward pool, the zeros until the scatter,
  whose output they become (examples/vgg16.py: 30 MiB of iotas, 8 MiB of zeros).

  The pool also writes the argmax (one s32 per output element and dimension) while its
  operand is live; later the argmax stands in for the operand, which the graph keeps
  for the scatter (the same bytes for a 2x2, stride-2 pool of a rank-4 operand), so it
  is scratch of the pool node.

  Returns, per group of a forward ``reduce_window_max`` whose operand a
  ``select_and_scatter_add`` reads, the iota bytes and the argmax bytes, and the
  groups of those scatters.
  """
  eqns = jaxpr.eqns
  scattered = {e.invars[1] for e in eqns if e.primitive.name == "select_and_scatter_add"}
  iotas: dict[int, int] = {}
  indices: dict[int, int] = {}
  hoisted = set()
  for gi, g in enumerate(groups):
    for k in g:
      e = eqns[k]
      if e.primitive.name == "select_and_scatter_add":
        hoisted.add(gi)
      if e.primitive.name == "reduce_window_max" and e.invars[0] in scattered:
        aval, out = e.invars[0].aval, e.outvars[0].aval
        iotas[gi] = iotas.get(gi, 0) + aval.ndim * math.prod(aval.shape) * 4
        indices[gi] = indices.get(gi, 0) + aval.ndim * math.prod(out.shape) * 4
  return iotas, indices, hoisted


def _dot_operand_canonical(ndim: int, batch: Sequence[int], contract: Sequence[int]) -> bool:
  nb, nc = len(batch), len(contract)
  if tuple(batch) != tuple(range(nb)):
    return False
  return tuple(contract) in (tuple(range(nb, nb + nc)), tuple(range(ndim - nc, ndim)))


def internal_bytes(eqn: Any) -> int:
  """Estimated bytes live inside a scan/while/cond body beyond its carried values.

  The largest sum of one body's equation outputs is an upper bound on what one
  iteration keeps live at once; the body's own inputs and outputs are the node's.
  """
  best = 0
  for body in compat.inner_jaxprs(eqn):
    total = sum(compat.aval_bytes(v.aval) for e in body.eqns for v in e.outvars)
    best = max(best, total)
  return best
