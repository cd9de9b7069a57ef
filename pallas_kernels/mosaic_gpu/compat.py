"""The few Mosaic GPU Pallas spellings that differ between the jax versions we run.

jax 0.10.2 (CPU CI) transposes a shared-memory ref with ``plgpu.transpose_ref(ref, perm)``;
jax 0.11 deprecates that for ``ref.transpose(perm)``, which 0.10.2's GPU lowering does not
take for wgmma operands.
"""
from __future__ import annotations

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


def transposed(ref):
  """A 2-D shared-memory ref seen transposed (a wgmma B operand read as ``K^T``)."""
  if JAX_VERSION < (0, 11):
    return plgpu.transpose_ref(ref, (1, 0))
  return ref.transpose((1, 0))


def interpret_params():
  """Parameters that run a Mosaic GPU kernel on CPU in interpret mode (both versions keep
  the class in the same private module; 0.11 also exports it as plgpu.InterpretGPUParams)."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()
