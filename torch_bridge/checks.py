"""Host checks of the facade's torch inputs: slot mappings, metadata values, global scales,
and the cache's storage.

The facade's JAX functions run under ``jit``, where kvjax cannot read values, so
the facade reads them itself where that costs no device synchronization: CPU
tensors always; CUDA tensors only when asked (``check_cuda_inputs=True``: a
device-to-host copy, so the host waits for the work torch queued before it).
The rules are kvjax's own (:mod:`kvjax.validation`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvjax import validation as V
from kvjax.spec import KVCacheSpec

_I32 = torch.iinfo(torch.int32)


def host_values(t: torch.Tensor, on_cuda: bool) -> Optional[np.ndarray]:
  """``t``'s values as numpy: always for CPU tensors, for CUDA ones only if ``on_cuda``."""
  if t.device.type == "cpu":
    return t.detach().numpy()
  return t.detach().cpu().numpy() if on_cuda else None


def saturate_int32(t: torch.Tensor) -> torch.Tensor:
  """int32 ``t``, values beyond int32's range clamped to its ends (never wrapped)."""
  if t.dtype == torch.int32:
    return t
  return t.clamp(_I32.min, _I32.max).to(torch.int32)


def slots_int32(slot_mapping: torch.Tensor, num_slots: int, on_cuda: bool,
                length: Optional[int] = None) -> torch.Tensor:
  """int32 slots, checked (< num_slots) where readable. Wider slots are clamped to
  ``[-1, num_slots]`` before the narrowing, so every slot outside ``[0, num_slots)`` stays
  outside (a skip, or dropped past the end: kvjax's rule, ``kvjax.slots``), where
  ``.to(torch.int32)`` alone would wrap -(2**32) + 5 (a skip) to slot 5.
  ``length``: pad with -1 (skips) to this many slots (a new tensor when padded)."""
  host = host_values(slot_mapping, on_cuda)
  if host is not None:
    V.check_slot_values("slot_mapping", host, num_slots, negative_ok=True)
  if slot_mapping.dtype != torch.int32:     # -1 and num_slots are skips alike: two kernels
    slot_mapping = slot_mapping.clamp(-1, num_slots).to(torch.int32)
  extra = 0 if length is None else length - slot_mapping.shape[0]
  if extra > 0:
    slot_mapping = torch.nn.functional.pad(slot_mapping, (0, extra), value=-1)
  return slot_mapping


def check_scales(spec: KVCacheSpec, k_scale, v_scale, on_cuda: bool):
  """kvjax's global-scale rules (finite, positive, shape) on readable values."""
  def host(s):
    return host_values(s, on_cuda) if isinstance(s, torch.Tensor) else s
  V.check_scales(spec, host(k_scale), host(v_scale))


def storage_bytes_needed(tensor: torch.Tensor) -> int:
  """Bytes of its storage that ``tensor`` addresses (from the storage's start)."""
  if not tensor.numel():
    return 0
  last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
  return (last + 1) * tensor.element_size()


def check_storage(tensor: torch.Tensor, name: str = "kv_cache", need: Optional[int] = None):
  """The tensor's storage still holds every element it addresses.

  A storage resized in place (``untyped_storage().resize_``, ``resize_``) frees the
  memory that imported JAX arrays point at; refuse it instead of reading freed memory.
  ``need``: :func:`storage_bytes_needed` of the tensor, when the caller kept it (O(1)).
  """
  storage = tensor.untyped_storage()
  if need is None:
    need = storage_bytes_needed(tensor)
  if storage.nbytes() < need or (need and storage.data_ptr() == 0):
    raise ValueError(f"{name}'s storage was resized or freed: it holds {storage.nbytes()} bytes, "
                     f"the tensor addresses {need}. A cache must keep its memory while the "
                     "backend uses it; allocate a new cache instead")
