"""Shareable device memory of one device, handed out in aligned pieces (the CUDA IPC
transport's offers live in these)."""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

#: Bytes of shareable device memory a server allocates at a time (more for a larger offer).
DEFAULT_SLAB_BYTES = 256 << 20
_ALIGN = 256


class Piece(NamedTuple):
  """``nbytes`` at ``offset`` of slab ``slab`` (whose IPC handle is ``handle``)."""
  slab: int
  offset: int
  nbytes: int
  ptr: int
  handle: bytes


class Slabs:
  """Shareable memory of one device, handed out in aligned pieces (first fit); grows a slab
  at a time and keeps its slabs until :meth:`free_all`. Not thread-safe: callers lock."""

  def __init__(self, memory, device, slab_bytes: int = DEFAULT_SLAB_BYTES):
    self.memory, self.device, self.slab_bytes = memory, device, int(slab_bytes)
    self._slabs: List[Tuple[int, int, bytes]] = []     # (ptr, size, handle)
    self._free: List[List[Tuple[int, int]]] = []       # per slab: sorted free [start, end)

  @property
  def capacity(self) -> int:
    return sum(size for _, size, _ in self._slabs)

  def take(self, nbytes: int) -> Piece:
    size = -(-int(nbytes) // _ALIGN) * _ALIGN
    for s, ranges in enumerate(self._free):
      for i, (start, end) in enumerate(ranges):
        if end - start >= size:
          ranges[i:i + 1] = [(start + size, end)] if end - start > size else []
          ptr, _, handle = self._slabs[s]
          return Piece(s, start, int(nbytes), ptr + start, handle)
    slab_size = max(self.slab_bytes, size)
    ptr = self.memory.alloc(self.device, slab_size)
    self._slabs.append((ptr, slab_size, self.memory.handle(self.device, ptr)))
    self._free.append([(0, slab_size)])
    return self.take(nbytes)

  def give(self, piece: Piece) -> None:
    size = -(-piece.nbytes // _ALIGN) * _ALIGN
    ranges = sorted(self._free[piece.slab] + [(piece.offset, piece.offset + size)])
    merged = [ranges[0]]
    for start, end in ranges[1:]:
      if start == merged[-1][1]:
        merged[-1] = (merged[-1][0], end)
      else:
        merged.append((start, end))
    self._free[piece.slab] = merged

  def handles(self) -> List[Tuple[int, bytes]]:
    """(start, IPC handle) of every slab."""
    return [(ptr, handle) for ptr, _, handle in self._slabs]

  def free_all(self) -> None:
    slabs, self._slabs, self._free = self._slabs, [], []
    for ptr, _, _ in slabs:
      self.memory.free(self.device, ptr)


__all__ = ["DEFAULT_SLAB_BYTES", "Piece", "Slabs"]
