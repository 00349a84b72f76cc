"""What every example shares: blocks, jax.checkpoint variants, the optax step and the CLI.

Every model's ``loss(params, batch, *, checkpoint=None)`` runs its repeated part through
`run_blocks`, so the jax.checkpoint variants a user would try by hand (`CHECKPOINT_VARIANTS`)
apply to every example the same way, and `main` is each ``python -m examples.NAME``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

# The jax.checkpoint variants of a loss: three policies over the whole loss, one
# checkpoint per block, and segments of about sqrt(n) blocks (Chen et al. 2016).
CHECKPOINT_VARIANTS = (
  "nothing_saveable",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "per_block",
  "sqrt_n",
)
# Where the device has a host memory space to offload to (TPU, GPU): the blocks under one
# jax.checkpoint whose policy offloads each block's output to pinned host memory and
# recomputes the rest in the backward pass.
OFFLOAD_VARIANT = "offload_blocks"
_BLOCK_VARIANTS = ("per_block", "sqrt_n", OFFLOAD_VARIANT)
_BLOCK_OUTPUT = "block_output"
_DN = ("NHWC", "HWIO", "NHWC")


# -- model pieces ---------------------------------------------------------------------


def conv2d(w, x, stride=1, groups=1):
  """A 'SAME' NHWC convolution with an HWIO kernel (``groups=C`` makes it depthwise)."""
  return jax.lax.conv_general_dilated(
    x, w, (stride, stride), "SAME", dimension_numbers=_DN, feature_group_count=groups
  )


def channel_norm(p, x):
  """Training-mode batch normalization over (batch, height, width), then scale and shift.

  Batch statistics, no running averages to carry. Per-example statistics would be taken
  over as few as 2x2 values in the last blocks, which amplifies float32 rounding.
  """
  mean = x.mean((0, 1, 2), keepdims=True)
  var = x.var((0, 1, 2), keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def run_blocks(
  blocks: Sequence[tuple[Callable[[Any, Any], Any], Any]], x: Any, checkpoint: str | None = None
) -> Any:
  """Applies ``blocks``, ``(fn, params)`` pairs with ``fn(params, x) -> x``, in order.

  Args:
    blocks: the model's repeated part.
    x: the state carried from block to block (an array or a pytree).
    checkpoint: None runs the blocks as they are; ``"per_block"`` wraps each block in
      `jax.checkpoint`; ``"sqrt_n"`` wraps runs of ``round(sqrt(n))`` consecutive blocks;
      ``"offload_blocks"`` runs them all under one `jax.checkpoint` that offloads each
      block's output to pinned host memory (``save_and_offload_only_these_names``).

  Returns:
    The state after the last block.

  References:
    Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016
    (section 4.1: sqrt(n) segments).
  """
  if checkpoint is None:
    for fn, p in blocks:
      x = fn(p, x)
    return x
  if checkpoint not in _BLOCK_VARIANTS:
    raise ValueError(
      f"checkpoint={checkpoint!r} is not a block variant; use None or one of {_BLOCK_VARIANTS}."
    )
  if checkpoint == OFFLOAD_VARIANT:
    fns, ps = zip(*blocks, strict=True)

    def offloaded(ps, x):
      for fn, p in zip(fns, ps, strict=True):
        x = checkpoint_name(fn(p, x), _BLOCK_OUTPUT)
      return x

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(),
      names_which_can_be_offloaded=(_BLOCK_OUTPUT,),
      offload_src="device",
      offload_dst="pinned_host",
    )
    return jax.checkpoint(offloaded, policy=policy)(ps, x)
  size = 1 if checkpoint == "per_block" else max(1, round(math.sqrt(len(blocks))))
  for start in range(0, len(blocks), size):
    fns, ps = zip(*blocks[start : start + size], strict=True)

    def segment(ps, x, fns=fns):
      for fn, p in zip(fns, ps, strict=True):
        x = fn(p, x)
      return x

    x = jax.checkpoint(segment)(ps, x)
  return x


def checkpointed_loss(module, variant: str | None) -> Callable:
  """``module.loss`` as a user would checkpoint it by hand (`CHECKPOINT_VARIANTS`, or None)."""
  if variant is None:
    return module.loss
  if variant in _BLOCK_VARIANTS:
    return functools.partial(module.loss, checkpoint=variant)
  if variant in CHECKPOINT_VARIANTS:  # a policy over the whole loss
    return jax.checkpoint(module.loss, policy=getattr(jax.checkpoint_policies, variant))
  raise ValueError(
    f"variant={variant!r} is not a jax.checkpoint variant; use None or one of "
    f"{(*CHECKPOINT_VARIANTS, OFFLOAD_VARIANT)}."
  )


# -- training step --------------------------------------------------------------------


def example_args(module, **sizes) -> tuple[Any, Any]:
  """``(params, batch)`` from key 0; each size goes to whichever of ``module.init_params``
  and ``module.example_batch`` takes it (both, for shared ones such as ``d_in``)."""
  takes = {
    fn: set(inspect.signature(fn).parameters) - {"key"}
    for fn in (module.init_params, module.example_batch)
  }
  unknown = set(sizes) - set().union(*takes.values())
  if unknown:
    raise ValueError(
      f"sizes {sorted(unknown)} are not sizes of {module.__name__}; it takes "
      f"{sorted(set().union(*takes.values()))}."
    )
  key = jax.random.key(0)
  params, batch = (
    fn(key, **{k: v for k, v in sizes.items() if k in names}) for fn, names in takes.items()
  )
  return params, batch


def default_batch(module) -> int:
  """The batch size ``module.example_batch`` makes by default."""
  return inspect.signature(module.example_batch).parameters["batch"].default


def make_train_step(loss, params, batch, learning_rate=1e-3):
  """A jitted ``(params, opt_state, batch) -> (params, opt_state, loss)`` and its arguments."""
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(params)

  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return train_step, (params, opt_state, batch)


def step_makers(module_name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
  """The ``make_grad_fn(**sizes)`` and ``make_train_step(**sizes)`` of an example module
  that defines ``loss``, ``init_params`` and ``example_batch``."""
  adam_step = make_train_step

  def make_grad_fn(**sizes):
    """``jax.value_and_grad(loss)`` and its example arguments ``(params, batch)``."""
    module = sys.modules[module_name]
    return jax.value_and_grad(module.loss), example_args(module, **sizes)

  def make_train_step_(**sizes):
    """The optax (Adam) training step and its example arguments."""
    _, (params, batch) = make_grad_fn(**sizes)
    return adam_step(sys.modules[module_name].loss, params, batch)

  make_train_step_.__name__ = make_train_step_.__qualname__ = "make_train_step"
  return make_grad_fn, make_train_step_


# -- command line ---------------------------------------------------------------------


def _summary(label: str, m) -> str:
  return (
    f"{label}: XLA peak {m.peak_bytes / 2**20:.2f} MiB, {m.flops or 0:.4g} FLOPs, "
    f"{(m.wall_time_s or 0) * 1e3:.2f} ms per step (median)"
  )


def main(module, argv: Sequence[str] | None = None) -> bool:
  """``python -m examples.NAME``: runs the training step, with jaxremat at ``--budget``.

  Without ``--budget`` it runs ``--steps`` steps and prints XLA's peak, FLOPs and wall
  time. With it, it also plans the step with `jaxremat.optimize`, prints the report (XLA's
  peak, FLOPs and wall time before and after) and runs both steps side by side to check
  that the losses match (rtol 1e-5).

  Returns:
    Whether the losses matched (True without ``--budget``).
  """
  import jaxremat

  name = module.__spec__.name if module.__spec__ else module.__name__
  parser = argparse.ArgumentParser(prog=f"python -m {name}", description=module.__doc__)
  parser.add_argument("--budget", help="jaxremat's budget: 0.5, 60%%, 12MiB or bytes")
  parser.add_argument("--solver", default="auto")
  parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--runs", type=int, default=5, help="timed calls for the wall time")
  parser.add_argument(
    "--checkpoint",
    choices=CHECKPOINT_VARIANTS,
    help="checkpoint the loss by hand with this jax.checkpoint variant first",
  )
  parser.add_argument("--small", action="store_true", help="the smallest sizes (for tests)")
  parser.add_argument("--no-cache", action="store_true", help="plan afresh, store nothing")
  args = parser.parse_args(argv)

  params, batch = example_args(module, **(module.SMALL if args.small else {}))
  step, step_args = make_train_step(checkpointed_loss(module, args.checkpoint), params, batch)
  print(_summary("without jaxremat", jaxremat.measure(step, *step_args, runs=args.runs)))
  reference = jax.jit(step)
  if args.budget is None:
    state = step_args[:2]
    for i in range(args.steps):
      start = time.perf_counter()
      *state, value = reference(*state, batch)
      print(f"step {i}: loss {float(value):.6f} ({time.perf_counter() - start:.2f} s)")
    return True

  fast = jaxremat.optimize(
    step,
    budget=args.budget,
    solver=args.solver,
    time_limit=args.time_limit,
    use_cache=not args.no_cache,
  )
  report = fast.report(*step_args, runs=args.runs)
  print(_summary("with jaxremat   ", report.optimized))
  print(report)
  losses = []
  ref_state, fast_state = step_args[:2], step_args[:2]
  for _ in range(args.steps):
    *ref_state, ref_value = reference(*ref_state, batch)
    *fast_state, fast_value = fast(*fast_state, batch)
    losses.append((float(ref_value), float(fast_value)))
  ref_losses, fast_losses = np.array(losses).T
  same = bool(np.allclose(fast_losses, ref_losses, rtol=1e-5, atol=1e-6))
  rel = np.abs(fast_losses - ref_losses) / np.maximum(np.abs(ref_losses), 1e-30)
  print(f"{args.steps} steps, losses {ref_losses.tolist()} / {fast_losses.tolist()}")
  print(f"losses match: {same} (max relative difference {rel.max():.2e})")
  return same
