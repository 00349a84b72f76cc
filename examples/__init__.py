"""Runnable models and training steps for jaxremat (MLP, GPT, U-Net, ResNet).

Each module has ``init_params``, ``loss``, ``make_grad_fn`` (``jax.value_and_grad(loss)``
and its example arguments), ``make_train_step`` (loss, gradient and an optax update,
with example arguments) and a ``python -m examples.NAME`` main that runs a few steps.
"""

import importlib

EXAMPLES = ("mlp", "gpt", "unet", "resnet")


def load(name: str):
  """The example module ``examples.NAME``."""
  if name not in EXAMPLES:
    raise ValueError(f"example={name!r} does not exist; choose one of {list(EXAMPLES)}.")
  return importlib.import_module(f"examples.{name}")
