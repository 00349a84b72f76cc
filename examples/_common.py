"""What every example shares: the optax training step and the command-line main."""

import time

import jax
import optax


def make_train_step(loss, params, batch, learning_rate=1e-3):
  """A jitted ``(params, opt_state, batch) -> (params, opt_state, loss)`` and its arguments."""
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(params)

  def train_step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return train_step, (params, opt_state, batch)


def main(module, steps=3):
  step, args = module.make_train_step()
  step = jax.jit(step)
  params, opt_state, batch = args
  for i in range(steps):
    t0 = time.perf_counter()
    params, opt_state, value = step(params, opt_state, batch)
    print(
      f"{module.__spec__.name if module.__spec__ else module.__name__} step {i}: loss {float(value):.4f} ({time.perf_counter() - t0:.2f} s)"
    )
