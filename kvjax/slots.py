"""Slot mappings: the int32 slots every writer and reader indexes with.

A slot is ``block * block_size + offset``; a negative slot means "write nothing". Slots
outside ``[0, num_blocks * block_size)`` are dropped by every implementation (the public
ops reject them when the slot mapping is concrete).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def int32_slots(slot_mapping, num_slots: int):
  """int32 ``[T]`` slots, every slot outside ``[0, num_slots)`` replaced by -1.

  Wider integer slots (int64, uint32, uint64) are compared in their own dtype before the
  narrowing cast, so a slot such as ``2**32 + 5`` is dropped instead of wrapping to 5.
  int32 (and narrower) slots pass through unchanged: kernels bound-check them themselves.
  """
  xp = np if isinstance(slot_mapping, (np.ndarray, list, tuple)) else jnp   # numpy: no x64 wrap
  s = xp.asarray(slot_mapping)
  dt = np.dtype(s.dtype)
  if not (dt == np.dtype(np.int32) or (dt.itemsize < 4 and dt.kind in "iu")):
    ok = (s >= 0) & (s < num_slots) if dt.kind == "i" else s < num_slots
    s = xp.where(ok, s, -1)
  return jnp.asarray(s.astype(np.int32))
