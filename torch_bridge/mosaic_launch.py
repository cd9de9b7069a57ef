"""Mosaic GPU kernels launched from torch: one CUDA launch on torch's current stream.

A JAX function that calls exactly one Mosaic GPU kernel (``plgpu.kernel``) and nothing
else is lowered for CUDA once (no JAX device is touched), the kernel's module is compiled by
the CUDA plugin's ``MosaicGpuCompile`` (the entry point
``jax.experimental.pallas.mosaic_gpu.as_torch_kernel`` uses) and loaded into the current
CUDA context, the one torch uses. A call then fills one array of device pointers (inputs,
then outputs, as XLA passes them) and launches on ``torch.cuda.current_stream()``: no
event, no DLPack import, no host synchronization, so the launch is ordered with torch's
work and is captured by ``torch.cuda.graph`` like any torch kernel.

Outputs are tensors the caller allocates (the kernel writes into them): the caller owns
every buffer, so a captured graph replays over the same memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Sequence

import jax
import numpy as np

KERNEL_TARGET = "mosaic_gpu_v2"


@dataclasses.dataclass(frozen=True)
class KernelModule:
  """The compiled-to-be form of one Mosaic GPU kernel call.

  asm: the kernel's module (bytes, ``MosaicGpuCompile``'s input); inputs / outputs: their
  shapes and dtypes (numpy), in the launch's pointer order.
  """
  asm: bytes
  inputs: tuple
  outputs: tuple


def _walk(op):
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        yield child.operation
        yield from _walk(child.operation)


def kernel_module(fn, *arg_structs: jax.ShapeDtypeStruct) -> KernelModule:
  """Lower ``fn(*args)`` for CUDA and take its one Mosaic GPU kernel call.

  ``fn`` must pass its arguments to the kernel as they are, in order, and return the
  kernel's outputs as they are (no other JAX op: the launch runs the kernel only).
  Runs on any machine (CPU included). Raises ValueError naming what else it found.
  """
  lowered = jax.jit(fn).trace(*arg_structs).lower(lowering_platforms=("cuda",))
  module = lowered.compiler_ir()
  with module.context:
    ops = list(_walk(module.operation))
    calls = [op for op in ops if op.name == "stablehlo.custom_call"
             and op.attributes["call_target_name"].value == KERNEL_TARGET]
    others = sorted({op.name for op in ops} - {"func.func", "func.return",
                                                "stablehlo.custom_call"})
    if len(calls) != 1 or others:
      raise ValueError(f"fn must call exactly one Mosaic GPU kernel and nothing else; its "
                       f"lowering has {len(calls)} kernel calls and ops {others}")
    [call] = calls
    [main] = [op for op in ops if op.name == "func.func"]
    args = list(main.regions[0].blocks[0].arguments)
    if list(call.operands) != args:
      raise ValueError("fn must pass its arguments to the kernel unchanged and in order")
    [ret] = [op for op in ops if op.name == "func.return"]
    if list(ret.operands) != list(call.results):
      raise ValueError("fn must return the kernel's outputs unchanged and in order")
    asm = call.attributes["mhlo.backend_config"]["module"].value_bytes
  out = jax.tree.leaves(lowered.out_info)
  return KernelModule(
      asm, tuple((tuple(s.shape), np.dtype(s.dtype)) for s in arg_structs),
      tuple((tuple(s.shape), np.dtype(s.dtype)) for s in out))


def _plugin_library():
  """The CUDA plugin's shared library (it exports ``MosaicGpuCompile``)."""
  for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      plugin = __import__(name, fromlist=["_get_library_path"])
    except ImportError:
      continue
    return ctypes.CDLL(plugin._get_library_path())
  return ctypes.CDLL(None)     # a jaxlib built with CUDA inside


class TorchLaunch:
  """One compiled Mosaic GPU kernel, launched on torch tensors.

  ``launch(*buffers)``: inputs then outputs as torch CUDA tensors on ``device``, contiguous,
  of the shapes and dtypes of :attr:`module` (checked at the first launch, :meth:`check`;
  later launches read ``data_ptr()`` and nothing else, to stay a few microseconds).
  """

  def __init__(self, module: KernelModule, device):
    import torch   # noqa: PLC0415
    torch.cuda.init()
    self.device = torch.device(device)
    if self.device.index is None:
      self.device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(self.device):      # the context the module is loaded into
      self._load(module)
    self.module = module
    self._count = len(module.inputs) + len(module.outputs)
    self._torch = torch
    self._checked = False

  def _load(self, module: KernelModule):
    dll = _plugin_library()
    compile_fn = dll.MosaicGpuCompile
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    self._unload = dll.MosaicGpuUnload
    self._unload.argtypes = [compile_fn.restype]
    self._unload.restype = None
    compiled = compile_fn(ctypes.c_char_p(module.asm), ctypes.c_int(len(module.asm)))
    if not compiled:
      raise RuntimeError("MosaicGpuCompile failed to compile the kernel's module")
    self._compiled = compiled
    self._function = ctypes.c_void_p(compiled[0])
    self._launch = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_void_p))(compiled[1])

  def check(self, buffers: Sequence) -> None:
    """Raise ValueError unless ``buffers`` are contiguous CUDA tensors of the module's shapes
    and dtypes."""
    want = self.module.inputs + self.module.outputs
    if len(buffers) != len(want):
      raise ValueError(f"the kernel takes {len(want)} buffers, got {len(buffers)}")
    from torch_bridge.dtypes import numpy_dtype   # noqa: PLC0415
    for i, (t, (shape, dtype)) in enumerate(zip(buffers, want)):
      got = (tuple(t.shape), np.dtype(numpy_dtype(t.dtype)))
      if got != (shape, dtype) or t.device != self.device or not t.is_contiguous():
        raise ValueError(f"buffer {i}: expected a contiguous tensor {shape} {dtype} on "
                         f"{self.device}, "
                         f"got {got[0]} {got[1]} on {t.device}"
                         f"{'' if t.is_contiguous() else ', not contiguous'}")

  def launch(self, *buffers) -> None:
    """Launch on torch's current stream of the module's device (the buffers must be
    there)."""
    if not self._checked:
      self.check(buffers)
      self._checked = True
    ptrs = (ctypes.c_void_p * self._count)(*(t.data_ptr() for t in buffers))
    cuda = self._torch.cuda
    stream = ctypes.c_void_p(cuda.current_stream(self.device).cuda_stream)
    if cuda.current_device() == self.device.index:
      self._launch(self._function, stream, ptrs)
    else:
      with cuda.device(self.device):        # the module's context must be current
        self._launch(self._function, stream, ptrs)

  def __del__(self):
    compiled, self._compiled = getattr(self, "_compiled", None), None
    if compiled:
      self._unload(compiled)


class AttentionLaunch:
  """What an attention launcher keeps: one layer configuration's options, its compiled
  kernels (``_compiled``, by shape) and constant tensors (``_const``, by key).

  Args:
    spec: the cache's :class:`kvjax.KVCacheSpec`; num_heads: Hq.
    scale: softmax scale; sliding_window, soft_cap: as :func:`kvjax.unified_attention`.
    sinks: float32 numpy ``[Hq]`` sink logits or None.
  """

  def __init__(self, spec, num_heads: int, scale: float, sliding_window=None, soft_cap=None,
               sinks=None):
    self.spec, self.num_heads, self.scale = spec, num_heads, float(scale)
    self.window, self.soft_cap = sliding_window, soft_cap
    self.sinks = None if sinks is None else np.asarray(sinks, np.float32)
    self._compiled = {}
    self._consts = {}

  def _const(self, key, make):
    t = self._consts.get(key)
    if t is None:
      t = self._consts[key] = make()
    return t
