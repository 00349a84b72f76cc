"""A Flax linen CNN trained as Flax users write it: BatchNorm, Dropout and AdamW.

The model is a few conv blocks (``nn.Conv``, ``nn.BatchNorm``, ReLU, average pooling), then
global average pooling, ``nn.Dropout`` and a dense head. The training step::

    train_step(params, batch_stats, opt_state, images, labels, dropout_key, lr, *, train=True)

updates the mutable ``batch_stats`` collection (``mutable=["batch_stats"]``), draws dropout
masks from ``rngs={"dropout": dropout_key}`` and takes an ``optax.adamw`` step whose
learning rate ``lr`` is a float argument (``optax.inject_hyperparams``), so a schedule
computed in Python does not retrace. It returns the new ``params``, ``batch_stats`` and
``opt_state`` and ``{"loss", "accuracy"}``.

``train`` is static (it switches BatchNorm and Dropout between training and evaluation);
``params``, ``batch_stats`` and ``opt_state`` (arguments 0, 1 and 2) are donated, as the
step replaces them::

  step, args, kwargs = make_train_step("small")
  fast = jaxremat.optimize(
    step, budget=0.7, static_argnames=("train",), donate_argnums=(0, 1, 2)
  )
  params, batch_stats, opt_state, metrics = fast(*args, **kwargs)

``python -m examples.flax_cnn [--budget 0.5] [--small]`` runs a few steps, with jaxremat
at the budget if one is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

# Step arguments that jaxremat.optimize / jax.jit must be told about.
STATIC_ARGNAMES = ("train",)
DONATE_ARGNUMS = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class Sizes:
  """The example's sizes: square images of ``image`` pixels with ``channels`` channels."""

  batch: int
  image: int
  channels: int
  widths: tuple[int, ...]
  hidden: int
  n_classes: int


SIZES = {
  "small": Sizes(batch=16, image=16, channels=3, widths=(8, 16), hidden=32, n_classes=10),
  "default": Sizes(batch=32, image=32, channels=3, widths=(32, 64), hidden=128, n_classes=10),
}


class ConvBlock(nn.Module):
  """Two 3x3 convolutions, each followed by BatchNorm and ReLU, then 2x2 average pooling."""

  width: int

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    for _ in range(2):
      x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    return nn.avg_pool(x, (2, 2), strides=(2, 2))


class CNN(nn.Module):
  """Conv blocks of ``widths`` channels, global average pooling and a two-layer head."""

  widths: Sequence[int]
  hidden: int
  n_classes: int
  dropout_rate: float = 0.2

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    for width in self.widths:
      x = ConvBlock(width)(x, train=train)
    x = x.mean((1, 2))
    x = nn.Dense(self.hidden)(x)
    x = nn.relu(x)
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(self.n_classes)(x)


def make_train_step(
  size: str = "default", *, weight_decay: float = 1e-4
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
  """The training step and example arguments for it.

  Args:
    size: ``"small"`` (tiny, for tests) or ``"default"`` (32x32 images, batch 32, widths
      32 and 64).
    weight_decay: AdamW's decoupled weight decay.

  Returns:
    ``(train_step, args, kwargs)``: ``train_step(*args, **kwargs)`` runs one step.
    ``args`` are ``(params, batch_stats, opt_state, images, labels, dropout_key)`` and
    ``kwargs`` is ``{"lr": 1e-3, "train": True}`` (``lr`` a Python float, traced).
    ``train`` is static; arguments 0, 1 and 2 may be donated (`STATIC_ARGNAMES`,
    `DONATE_ARGNUMS`).

  Example:
    >>> step, args, kwargs = make_train_step("small")
    >>> params, batch_stats, opt_state, metrics = jax.jit(step, static_argnames="train")(
    ...     *args, **kwargs)
    >>> sorted(metrics)
    ['accuracy', 'loss']
  """
  if size not in SIZES:
    raise ValueError(f"size={size!r} is not a size of this example; use one of {list(SIZES)}.")
  s = SIZES[size]
  model = CNN(widths=s.widths, hidden=s.hidden, n_classes=s.n_classes)
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=weight_decay)

  def train_step(params, batch_stats, opt_state, images, labels, dropout_key, lr, *, train=True):
    def loss_fn(params):
      logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats},
        images,
        train=train,
        rngs={"dropout": dropout_key},
        mutable=["batch_stats"],
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, (logits, updates["batch_stats"])

    (loss, (logits, batch_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # The learning rate as the state's own dtype: a weakly typed float would change the
    # state's type after the first step, and with it the signature (a new compilation).
    hyperparams = opt_state.hyperparams
    lr = jnp.asarray(lr, hyperparams["learning_rate"].dtype)
    opt_state = opt_state._replace(hyperparams={**hyperparams, "learning_rate": lr})
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    accuracy = (logits.argmax(-1) == labels).mean()
    return params, batch_stats, opt_state, {"loss": loss, "accuracy": accuracy}

  key_init, key_images, key_labels, key_dropout = jax.random.split(jax.random.key(0), 4)
  images = jax.random.normal(key_images, (s.batch, s.image, s.image, s.channels))
  labels = jax.random.randint(key_labels, (s.batch,), 0, s.n_classes)
  variables = model.init(key_init, images, train=False)
  params, batch_stats = variables["params"], variables["batch_stats"]
  opt_state = optimizer.init(params)
  args = (params, batch_stats, opt_state, images, labels, key_dropout)
  return train_step, args, {"lr": 1e-3, "train": True}


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
  """``python -m examples.flax_cnn``: a few steps, with jaxremat at ``--budget``."""
  parser = argparse.ArgumentParser(prog="python -m examples.flax_cnn", description=__doc__)
  parser.add_argument("--budget", help="jaxremat's budget: 0.5, 60%%, 12MiB or bytes")
  parser.add_argument("--time-limit", type=float, default=60.0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--small", action="store_true", help="the small sizes (for tests)")
  args = parser.parse_args(argv)

  step, step_args, kwargs = make_train_step("small" if args.small else "default")
  options = {"static_argnames": STATIC_ARGNAMES, "donate_argnums": DONATE_ARGNUMS}
  if args.budget is None:
    run = jax.jit(step, **options)
  else:
    run = optimize_or_retry(
      step, step_args, kwargs, budget=args.budget, time_limit=args.time_limit, **options
    )
    print(run.report(*step_args, **kwargs))
  state, (images, labels, key) = step_args[:3], step_args[3:]
  for i in range(args.steps):
    start = time.perf_counter()
    # A fresh dropout key and a decaying learning rate each step: no new compilation.
    step_kwargs = {**kwargs, "lr": kwargs["lr"] / (i + 1)}
    *state, metrics = run(*state, images, labels, jax.random.fold_in(key, i), **step_kwargs)
    print(
      f"step {i}: loss {float(metrics['loss']):.6f}, accuracy {float(metrics['accuracy']):.2f} "
      f"({time.perf_counter() - start:.2f} s)"
    )


if __name__ == "__main__":
  main()
