"""One cache buffer, two frameworks: ``to_torch`` / ``from_torch`` through DLPack, no copy.

The JAX value is always the *physical* contiguous array (``spec.physical_shape``);
torch gets vLLM's *logical* view of the same memory (``spec.logical_shape``, the
spec's stride order), so ``logical.data_ptr() == jax_array.unsafe_buffer_pointer()``.

Rules (checked on CPU and on an H200; hazards in docs/edges.md):
- only the physical contiguous tensor crosses: a permuted view would import as a
  JAX array with a non-default layout that Pallas calls silently transpose;
- CPU: JAX imports zero-copy only from 64-byte aligned addresses (else it copies),
  so misaligned tensors are refused; :func:`empty_cache` allocates aligned;
- fp8 per-tensor caches live as uint8 in vLLM: the bytes are reinterpreted on the
  torch side (``tensor.view(torch.float8_e4m3fn)``, free) because a JAX bitcast
  would materialize a copy;
- a JAX-owned buffer that torch views must not be donated by JAX afterwards
  (CUDA: "Donation requested for buffer with external reference").
"""
from __future__ import annotations

from typing import Optional

import jax
import torch

from kvjax.spec import KVCacheSpec
from torch_bridge import dtypes
from torch_bridge import layout as L


def _check_jax_cache(cache, spec: KVCacheSpec):
  if not isinstance(cache, jax.Array):
    raise TypeError(f"cache must be a jax.Array, got {type(cache).__name__}")
  if len(cache.devices()) != 1:
    raise ValueError("a sharded cache has no single buffer to share: pass one shard "
                     "(cache.addressable_shards[i].data)")
  if cache.ndim == 4:
    spec.num_blocks_of(cache)
    return
  if cache.ndim == 5:
    b = cache.shape[0]
    order = spec.stride_order(True)
    layers = cache.shape[order.index(0)]
    want = spec.physical_shape(b, layers)
    if tuple(cache.shape) != want:
      raise ValueError(f"5-D cache shape {tuple(cache.shape)} is not the spec's physical shape "
                       f"{want}")
    if cache.dtype != spec.storage_dtype:
      raise TypeError(f"cache dtype {cache.dtype} is not {spec.storage_dtype}")
    return
  raise ValueError(f"cache must be the 4-D (or 5-D) physical array, got shape {cache.shape}")


def to_torch(cache, spec: KVCacheSpec, *, as_uint8: Optional[bool] = None) -> torch.Tensor:
  """The JAX physical cache as a torch tensor with vLLM's logical shape, sharing memory.

  Args:
    cache: the spec's physical array, ``spec.physical_shape(B)`` (or 5-D with layers).
    as_uint8: fp8 per-tensor caches only: True (default) gives torch.uint8 like
      vLLM, False the fp8 dtype. Other caches keep their storage dtype
      (int8, uint8 for nvfp4 / int4 / fp8 per-token-head, or the model dtype).
  Returns:
    ``(B, H, N, C)`` view (strides of the spec's stride order) whose
    ``data_ptr()`` is ``cache.unsafe_buffer_pointer()``. On CUDA, torch's current
    stream waits for the array to be ready (DLPack stream protocol).
  """
  _check_jax_cache(cache, spec)
  if as_uint8 is not None and not dtypes.stores_fp8(spec):
    raise ValueError(f"as_uint8 applies to fp8 per-tensor caches, not {spec.cache_dtype!r}")
  phys = torch.from_dlpack(cache)
  if not phys.is_contiguous():
    raise ValueError("the JAX cache array has a non-default memory layout; pass the physical "
                     "array in row-major layout")
  if dtypes.stores_fp8(spec) and as_uint8 is not False:
    phys = phys.view(torch.uint8)
  order = spec.stride_order(phys.ndim == 5)
  logical = phys.permute(tuple(order.index(i) for i in range(len(order))))
  if logical.data_ptr() != cache.unsafe_buffer_pointer():
    raise RuntimeError("torch.from_dlpack copied the cache; expected a shared buffer")
  return logical


def jax_device_of(tensor: torch.Tensor):
  """The JAX device that addresses ``tensor``'s memory (ValueError if JAX has none)."""
  platform = {"cpu": "cpu", "cuda": "gpu"}.get(tensor.device.type)
  if platform is None:
    raise ValueError(f"tensor on device {tensor.device} cannot be shared with JAX")
  try:
    devices = jax.devices(platform)
  except RuntimeError as e:
    raise ValueError(f"tensor is on {tensor.device} but JAX has no {platform} backend") from e
  index = tensor.device.index or 0
  for d in devices:
    if d.local_hardware_id == index or (platform == "cpu" and d.id == index):
      return d
  raise ValueError(f"JAX has no {platform} device {index} for tensor on {tensor.device}")


def import_physical(phys: torch.Tensor) -> jax.Array:
  """Zero-copy import of a contiguous, shareable physical tensor; verifies the pointer."""
  L.check_shareable(phys)
  jax_device_of(phys)
  if phys.requires_grad:
    phys = phys.detach()
  arr = jax.dlpack.from_dlpack(phys, copy=False)
  if arr.unsafe_buffer_pointer() != phys.data_ptr():
    raise RuntimeError("jax.dlpack.from_dlpack copied the tensor; expected a shared buffer")
  return arr


def storage_typed(phys: torch.Tensor, spec: KVCacheSpec) -> torch.Tensor:
  """The physical tensor with the spec's storage dtype (uint8 bytes viewed as fp8, free)."""
  want = dtypes.torch_dtype(spec.storage_dtype)
  return phys if phys.dtype == want else phys.view(want)


def from_torch(tensor, spec: KVCacheSpec, *, view: Optional[str] = None) -> jax.Array:
  """The JAX physical cache sharing ``tensor``'s memory (never a copy).

  Args:
    tensor: vLLM's logical view ``(B, H, N, C)`` (permuted, compact) or the
      physical contiguous tensor (4-D, or 5-D with a layers dim); dtype the
      spec's storage dtype, or uint8 for an fp8 per-tensor cache.
    view: None (tell from shape and strides), "logical" or "physical". Needed
      for a contiguous NHD tensor when ``num_kv_heads == block_size``, whose shape
      and strides fit both readings (refused without it).
  Returns:
    ``spec.physical_shape(B)`` array of ``spec.storage_dtype`` whose
    ``unsafe_buffer_pointer()`` is the tensor's ``data_ptr()``.
  Raises:
    TypeError: not a tensor, or a dtype the spec does not store.
    ValueError: a non-compact view (a K half, one head), a wrong shape, an
      ambiguous one, a CPU address not 64-byte aligned, or a device JAX does not
      address.
  The array borrows torch's memory: keep the tensor's storage alive and do not
  resize it while the array is in use (JAX cannot see that; it would read freed
  memory). On CUDA, JAX waits for torch's *current* stream before reading the
  array; later torch writes are not ordered against pending JAX reads (synchronize).
  """
  phys = L.physical_tensor(tensor, spec, view)
  return import_physical(storage_typed(phys, spec))


def empty_cache(spec: KVCacheSpec, num_blocks: int, *, device="cpu", num_layers=None,
                as_uint8: bool = True, fill: int = 0) -> torch.Tensor:
  """A new torch cache filled with ``fill``: logical view of a physical buffer JAX can import.

  On CPU the buffer starts 64-byte aligned (over-allocated and offset if torch's
  allocator did not align it). Returns the logical view like vLLM allocates it.
  """
  shape = spec.physical_shape(num_blocks, num_layers)
  dt = dtypes.cache_torch_dtype(spec, as_uint8)
  phys = torch.full(shape, fill, dtype=dt, device=device)
  if phys.device.type == "cpu" and phys.data_ptr() % L.CPU_ALIGNMENT:
    itemsize = phys.element_size()
    pad = L.CPU_ALIGNMENT // itemsize
    raw = torch.full((phys.numel() + pad,), fill, dtype=dt, device=device)
    skip = (-raw.data_ptr() % L.CPU_ALIGNMENT) // itemsize
    phys = raw[skip:skip + phys.numel()].view(shape)
  order = spec.stride_order(num_layers is not None)
  return phys.permute(tuple(order.index(i) for i in range(len(order))))
