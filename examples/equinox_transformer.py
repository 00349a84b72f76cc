"""A small Equinox transformer trained with Adam, as Equinox users write it.

The model embeds tokens (``eqx.nn.Embedding`` plus a learned position table), runs
pre-norm decoder blocks (``eqx.nn.LayerNorm``, causal multi-head self-attention, an
MLP whose activation ``jax.nn.gelu`` is a module field: a leaf of the model that is not
an array) and a linear head. The training step::

    step(model, opt_state, tokens, targets)

takes the gradient with ``eqx.filter_value_and_grad`` and an ``optax.adam`` step and
returns ``(model, opt_state, loss)``. It has no static arguments: the activation
function is a non-array leaf, which ``eqx.filter_jit`` and `jaxremat.optimize` keep static;
``model`` and ``opt_state`` (arguments 0 and 1) may be donated::

  step, args, kwargs = make_train_step("small")
  fast = jaxremat.optimize(step, budget=0.7, donate_argnums=(0, 1))
  model, opt_state, loss = fast(*args, **kwargs)

``python -m examples.equinox_transformer [--budget 0.5] [--small]`` runs a few steps,
with jaxremat at the budget if one is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

# Step arguments that jaxremat.optimize / jax.jit may be told about.
DONATE_ARGNUMS = (0, 1)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The example's sizes."""

  batch: int
  seq_len: int
  vocab: int
  d_model: int
  n_heads: int
  n_layers: int


SIZES = {
  "small": Sizes(batch=8, seq_len=32, vocab=32, d_model=16, n_heads=2, n_layers=2),
  "default": Sizes(batch=8, seq_len=64, vocab=256, d_model=64, n_heads=4, n_layers=4),
}


class MLP(eqx.Module):
  """``fc2(activation(fc1(x)))``; ``activation`` is a field, so a (non-array) leaf."""

  fc1: eqx.nn.Linear
  fc2: eqx.nn.Linear
  activation: Callable[[jax.Array], jax.Array]

  def __init__(self, d_model: int, hidden: int, activation: Callable, *, key: jax.Array):
    k1, k2 = jax.random.split(key)
    self.fc1 = eqx.nn.Linear(d_model, hidden, key=k1)
    self.fc2 = eqx.nn.Linear(hidden, d_model, key=k2)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(self.activation(self.fc1(x)))


class CausalSelfAttention(eqx.Module):
  """Multi-head causal self-attention of one sequence, (seq_len, d_model) -> same.

  Written out rather than ``eqx.nn.MultiheadAttention``, whose attention dropout keeps
  Python ``float`` and ``bool`` fields (``p``, ``inference``) among the model's leaves:
  ``jaxremat.optimize(step)`` traces those as `jax.jit` traces Python scalars (its dropout
  then branches on a tracer), and only ``optimize(eqx.filter_jit(step))`` keeps them static
  as ``eqx.filter_jit`` does. Written out, the step works either way.
  """

  qkv: eqx.nn.Linear
  proj: eqx.nn.Linear
  n_heads: int = eqx.field(static=True)

  def __init__(self, d_model: int, n_heads: int, *, key: jax.Array):
    k1, k2 = jax.random.split(key)
    self.qkv = eqx.nn.Linear(d_model, 3 * d_model, key=k1)
    self.proj = eqx.nn.Linear(d_model, d_model, key=k2)
    self.n_heads = n_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    t, d = x.shape
    q, k, v = jnp.split(jax.vmap(self.qkv)(x).reshape(t, 3, self.n_heads, d // self.n_heads), 3, 1)
    scores = jnp.einsum("qhd,khd->hqk", q[:, 0], k[:, 0]) / jnp.sqrt(d // self.n_heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v[:, 0])
    return jax.vmap(self.proj)(out.reshape(t, d))


class Block(eqx.Module):
  """A pre-norm decoder block: causal self-attention, then the MLP, each residual."""

  norm1: eqx.nn.LayerNorm
  attention: CausalSelfAttention
  norm2: eqx.nn.LayerNorm
  mlp: MLP

  def __init__(self, d_model: int, n_heads: int, *, key: jax.Array):
    k1, k2 = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(d_model)
    self.attention = CausalSelfAttention(d_model, n_heads, key=k1)
    self.norm2 = eqx.nn.LayerNorm(d_model)
    self.mlp = MLP(d_model, 4 * d_model, jax.nn.gelu, key=k2)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x``: (seq_len, d_model), one sequence, as Equinox layers take it."""
    x = x + self.attention(jax.vmap(self.norm1)(x))
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
  """Token and position embeddings, decoder blocks, a final LayerNorm and the head."""

  embedding: eqx.nn.Embedding
  positions: jax.Array
  blocks: list[Block]
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, s: Sizes, *, key: jax.Array):
    keys = jax.random.split(key, 3 + s.n_layers)
    self.embedding = eqx.nn.Embedding(s.vocab, s.d_model, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (s.seq_len, s.d_model))
    self.blocks = [Block(s.d_model, s.n_heads, key=k) for k in keys[3:]]
    self.norm = eqx.nn.LayerNorm(s.d_model)
    self.head = eqx.nn.Linear(s.d_model, s.vocab, key=keys[2])

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (seq_len, vocab) of one sequence of ``tokens`` (seq_len,)."""
    x = jax.vmap(self.embedding)(tokens) + self.positions[: tokens.shape[0]]
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def make_train_step(
  size: str = "default", *, learning_rate: float = 1e-3
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
  """The training step and example arguments for it.

  Args:
    size: ``"small"`` (tiny, for tests) or ``"default"`` (batch 8 of 64 tokens, 4 layers of
      width 64).
    learning_rate: Adam's learning rate.

  Returns:
    ``(step, args, kwargs)``: ``step(*args, **kwargs)`` runs one step. ``args`` are
    ``(model, opt_state, tokens, targets)``, ``kwargs`` is empty; arguments 0 and 1 may
    be donated (`DONATE_ARGNUMS`).

  Example:
    >>> step, args, kwargs = make_train_step("small")
    >>> model, opt_state, loss = eqx.filter_jit(step)(*args, **kwargs)
    >>> model.blocks[0].mlp.activation is jax.nn.gelu
    True
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not a size of this example; use one of {list(SIZES)}.")
  s = SIZES[size]
  optimizer = optax.adam(learning_rate)

  def step(model, opt_state, tokens, targets):
    @eqx.filter_value_and_grad
    def loss_fn(model):
      logits = jax.vmap(model)(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = loss_fn(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  key_model, key_tokens = jax.random.split(jax.random.key(0))
  model = Transformer(s, key=key_model)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
  data = jax.random.randint(key_tokens, (s.batch, s.seq_len + 1), 0, s.vocab)
  return step, (model, opt_state, data[:, :-1], data[:, 1:]), {}


def optimize_or_retry(step: Callable, args: tuple, kwargs: dict, *, budget: Any, **options: Any):
  """`jaxremat.optimize` planned on ``args``; where no plan it finds meets ``budget``, the
  plan it found, at the peak it states (`jaxremat.BudgetNotMetError`)."""
  import jaxremat

  run = jaxremat.optimize(step, budget=budget, **options)
  try:
    run.plan(*args, **kwargs)
  except jaxremat.BudgetNotMetError as e:
    print(f"{e}\nRetrying with budget={e.measured_peak_bytes}.")
    run = jaxremat.optimize(step, budget=e.measured_peak_bytes, **options)
    run.plan(*args, **kwargs)
  return run


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m examples.equinox_transformer``: a few steps, with jaxremat at ``--budget``."""
  parser = argparse.ArgumentParser(
    prog="python -m examples.equinox_transformer", description=__doc__
  )
  parser.add_argument("--budget", help="jaxremat's budget: 0.5, 60%%, 12MiB or bytes")
  parser.add_argument("--time-limit", type=float, default=60.0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--small", action="store_true", help="the small sizes (for tests)")
  args = parser.parse_args(argv)

  step, step_args, kwargs = make_train_step("small" if args.small else "default")
  if args.budget is None:
    run = eqx.filter_jit(step)
  else:
    run = optimize_or_retry(
      step,
      step_args,
      kwargs,
      budget=args.budget,
      time_limit=args.time_limit,
      donate_argnums=DONATE_ARGNUMS,
    )
    print(run.report(*step_args, **kwargs))
  model, opt_state, tokens, targets = step_args
  for i in range(args.steps):
    start = time.perf_counter()
    model, opt_state, loss = run(model, opt_state, tokens, targets, **kwargs)
    print(f"step {i}: loss {float(loss):.6f} ({time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
  main()
