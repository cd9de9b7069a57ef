"""What differs between the jax versions this kernel meets (0.10.2 on CPU CI, 0.11.2 on GPUs).

* jax 0.11 defaults Mosaic GPU kernels to Warpgroup lowering semantics; 0.10.2 to Lane. The
  kernel asks for Lane semantics explicitly (explicit register layouts), so both versions run
  the same lowering (and 0.11.2's Warpgroup layout inference rejects this kernel).
* Interpret mode: both keep ``InterpretGPUParams`` in the same private module (0.11 also
  exports it from ``jax.experimental.pallas.mosaic_gpu``); only 0.11's interpreter runs this
  kernel (0.10.2's lacks out-of-bounds TMA reads and transposed wgmma operands).
* ``plgpu.transpose_ref`` is deprecated in 0.11: the kernel uses ``ref.transpose``, which
  both versions lower.
* ``plgpu.load(ref, idx, ...)``: 0.10.2 requires the index, 0.11 deprecates passing it
  (:func:`load_whole`).
"""
from __future__ import annotations

import warnings

import jax

JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


def interpret_params():
  """Parameters that run a Mosaic GPU kernel on CPU in interpret mode."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def load_whole(ref, *, layout, optimized: bool = True):
  """``plgpu.load`` of all of ``ref`` into registers of ``layout``. The ``()`` index is what
  jax 0.10.2 requires and what jax 0.11.2 runs (with a deprecation warning, silenced here)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Passing the index separately",
                            category=DeprecationWarning)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)
