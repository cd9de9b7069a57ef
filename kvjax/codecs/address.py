"""Where a (block, token, head) row of the cache is: the NHD / HND address, written once.

A page (block) of the physical cache is a grid of rows of ``C`` storage elements, one row per
(token, head): NHD stores it token-major ``(N, H, C)``, HND head-major ``(H, N, C)`` (the
stride orders ``(0, 2, 1, 3)`` and ``(0, 1, 2, 3)``). Every writer, reader and kernel takes
its row indices and element offsets from :class:`RowAddress`; the plain integer arithmetic
works on Python ints, numpy and jnp arrays alike (also inside Pallas kernels).
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RowAddress:
  """Row geometry of one page: ``num_heads`` x ``block_size`` rows of ``row_elems`` elements.

  Attributes:
    head_major: HND (heads outer) when True, NHD (tokens outer) when False.
    num_heads, block_size: H and N.
    row_elems: elements of one (token, head) row (the content dim C, or a narrower row such
      as nvfp4's ``D/2`` data bytes).
  """
  head_major: bool
  num_heads: int
  block_size: int
  row_elems: int

  @classmethod
  def of(cls, spec, row_elems=None) -> "RowAddress":
    """The rows of ``spec``'s pages (``row_elems`` defaults to the content dim)."""
    head_major = spec.stride_order()[1] == 1        # physical dim 1 holds the head axis
    c = spec.content_dim if row_elems is None else row_elems
    return cls(head_major, spec.num_kv_heads, spec.block_size, c)

  # -- strides ------------------------------------------------------------------------------------
  @property
  def token_stride(self) -> int:
    """Elements from one token's row to the next (same head)."""
    return self.row_elems if self.head_major else self.num_heads * self.row_elems

  @property
  def head_stride(self) -> int:
    """Elements from one head's row to the next (same token)."""
    return self.block_size * self.row_elems if self.head_major else self.row_elems

  @property
  def page_elems(self) -> int:
    return self.num_heads * self.block_size * self.row_elems

  # -- addresses ----------------------------------------------------------------------------------
  def offset(self, token, head):
    """Element offset of the (token, head) row inside its page."""
    return token * self.token_stride + head * self.head_stride

  def row(self, block, token, head):
    """Index of the (block, token, head) row in the cache viewed as rows ``[B*N*H, C]``."""
    if self.head_major:
      return (block * self.num_heads + head) * self.block_size + token
    return (block * self.block_size + token) * self.num_heads + head

  def row_of_slot(self, slot, head):
    """:meth:`row` of slot ``block * N + token`` (NHD needs no division: ``slot * H + h``)."""
    if self.head_major:
      return self.row(slot // self.block_size, head=head, token=slot % self.block_size)
    return slot * self.num_heads + head

  # -- jnp views -----------------------------------------------------------------------------------
  def token_major(self, pages):
    """``[P..., N, H, X]`` view of pages ``[P..., (N, H) or (H, N), X]`` (a transpose for HND)."""
    return jnp.swapaxes(pages, -3, -2) if self.head_major else pages

  def rows_at(self, block, token):
    """Index tuple of the ``[T, H, C]`` rows of slots (block, token) in a physical cache
    ``[B, ...]`` (for ``.at[...]`` scatters)."""
    return (block, slice(None), token) if self.head_major else (block, token)


@dataclasses.dataclass(frozen=True)
class ViewGeometry:
  """A strided view over the cache's flat storage: shape, element strides, element offset.

  Units are elements of ``dtype`` (the storage dtype, or float32 for scale views).
  """
  shape: Tuple[int, ...]
  strides: Tuple[int, ...]
  offset: int
  dtype: np.dtype
