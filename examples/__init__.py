"""Runnable models and training steps for jaxremat (MLP, GPT, U-Net, ResNet, VGG16, MobileNet).

Each module has ``init_params``, ``loss``, ``make_grad_fn`` (``jax.value_and_grad(loss)``
and its example arguments), ``make_train_step`` (loss, gradient and an optax update,
with example arguments), ``SMALL`` (the smallest sizes, for tests) and a
``python -m examples.NAME [--budget 0.5]`` main that runs a few steps, with jaxremat at
the budget if one is given. ``loss(..., checkpoint="per_block" | "sqrt_n")`` checkpoints
the model's blocks with `jax.checkpoint` (see ``examples._common.checkpointed_loss``).

``flax_cnn`` (Flax linen: BatchNorm, Dropout, AdamW with a float learning rate) and
``equinox_transformer`` (Equinox, Adam) write their steps as those libraries' users do, with
static and donated arguments; each has ``make_train_step(size) -> (step, args, kwargs)``
for ``size`` ``"small"`` or ``"default"`` and is not in `EXAMPLES`. ``scanned_gpt`` is the
GPT with its layers under `lax.scan` (stacked weights); its ``loss(..., checkpoint=...)``
takes a `jax.checkpoint_policies` name for the scan body or ``"nested"`` (sqrt(L) groups).
"""

import importlib

EXAMPLES = ("mlp", "gpt", "unet", "resnet", "vgg16", "mobilenet")


def load(name: str):
  """The example module ``examples.NAME``."""
  if name not in EXAMPLES:
    raise ValueError(f"example={name!r} does not exist; choose one of {list(EXAMPLES)}.")
  return importlib.import_module(f"examples.{name}")
