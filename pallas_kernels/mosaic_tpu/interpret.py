"""How a Mosaic TPU kernel runs: compiled for a TPU, or simulated on CPU in TPU interpret mode."""
from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu


def interpret_params(interpret):
  """``pallas_call``'s ``interpret`` argument for the entry points' ``interpret``.

  ``interpret``: False compiles for a TPU; True runs in TPU interpret mode (DMAs,
  semaphores, VMEM and SMEM simulated on CPU); a ``pltpu.InterpretParams`` is passed
  through (e.g. ``InterpretParams(detect_races=True)``).
  """
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  return pltpu.InterpretParams() if interpret else False
