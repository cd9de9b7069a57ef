"""The Triton IR of the Pallas-Triton kernels in a JAX function, lowered for CUDA on a CPU.

Pallas' Triton lowering runs without a GPU (``lowering_platforms=("cuda",)``); only the
compile to machine code needs one. :func:`triton_kernels` records the ``tt`` module of every
Pallas-Triton call as its lowering builds it, so a test can check the IR a GPU would compile
(e.g. that no NaN-dropping ``arith.maxnumf`` is in a writer).
"""
import dataclasses
import re
import sys


@dataclasses.dataclass
class TritonKernelIR:
  """One Pallas-Triton kernel: its ``tt.func`` name, the module as MLIR text with and without
  source locations, and its launch parameters."""
  name: str
  text: str
  text_plain: str
  num_warps: int
  num_stages: int


def triton_kernels(fn, *args) -> list:
  """The :class:`TritonKernelIR` of each Pallas-Triton call of ``fn(*args)`` in program order.

  ``args`` may be ``jax.ShapeDtypeStruct``; the kernels' choices that depend on the CUDA device
  are made for sm_90 (the H100 / H200)."""
  import jax
  from jax._src.pallas.triton import lowering as tt_lowering
  from pallas_kernels.triton import pairs

  kernels = []
  original = tt_lowering.lower_jaxpr_to_triton_module

  def hook(*a, **kw):
    result = original(*a, **kw)
    caller = sys._getframe(1).f_locals        # the lowering rule holds the launch parameters
    op = result.module.operation
    text = op.get_asm(enable_debug_info=True)
    found = re.search(r"tt\.func\s+(?:public\s+)?@([\w$.]+)", text)
    kernels.append(TritonKernelIR(found.group(1) if found else "kernel", text,
                                  op.get_asm(enable_debug_info=False),
                                  caller.get("num_warps"), caller.get("num_stages")))
    return result

  jax.clear_caches()                          # a cached lowering would not run the hook
  tt_lowering.lower_jaxpr_to_triton_module = hook
  capability, pairs.cuda_capability = pairs.cuda_capability, lambda: (9, 0)
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except Exception:
    if not kernels:                           # a jaxlib that compiles at lowering: IR is kept
      raise
  finally:
    tt_lowering.lower_jaxpr_to_triton_module = original
    pairs.cuda_capability = capability
  return kernels
