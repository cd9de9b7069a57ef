"""The Mosaic GPU ragged kernel's work items: which (KV head, query tile) a block walks, and
each item's key steps (scalars read from the tile metadata, :mod:`.tiles`)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu.kernel_statics import KernelStatics


class Tile(NamedTuple):
  """One work item's scalars: its query tile's metadata and its key steps ``[j_lo, j_hi)``,
  with ``[b, c_end)`` the steps every real row sees in full (no mask)."""
  h: jax.Array
  tok0: jax.Array
  nq: jax.Array
  pos0: jax.Array
  kv_len: jax.Array
  bt_row: jax.Array
  j_lo: jax.Array
  j_hi: jax.Array
  b: jax.Array
  c_end: jax.Array

  @property
  def num_steps(self):
    return self.j_hi - self.j_lo


def work_item(meta_ref, w, st: KernelStatics) -> Tile:
  """Work item ``w``: KV heads vary fastest; the tiles in reverse schedule order (each
  sequence's last tile, the one with the most keys, first; the last sequence first)."""
  bk = st.geo.block_kv
  h = lax.rem(w, st.num_kv_heads)
  tile = st.num_tiles - 1 - lax.div(w, st.num_kv_heads)
  tok0 = meta_ref[TL.META_TOK0, tile]
  nq = meta_ref[TL.META_NQ, tile]
  pos0 = meta_ref[TL.META_POS0, tile]
  kv_len = meta_ref[TL.META_KV_LEN, tile]
  pos_last = pos0 + nq - 1
  kv_hi = jnp.minimum(kv_len, pos_last + 1) if st.causal else kv_len
  kv_lo = jnp.maximum(pos0 - st.window + 1, 0) if st.window else jnp.int32(0)
  j_lo = lax.div(kv_lo, bk)
  j_hi = jnp.where((nq > 0) & (kv_hi > kv_lo), lax.div(kv_hi + bk - 1, bk), j_lo)
  full_lo = (lax.div(jnp.maximum(pos_last - st.window + 1, 0) + bk - 1, bk)
             if st.window else j_lo)
  full_end = jnp.minimum(pos0 + 1, kv_len) if st.causal else kv_len
  b = jnp.clip(full_lo, j_lo, j_hi)
  c_end = jnp.clip(lax.div(full_end, bk), b, j_hi)
  return Tile(h, tok0, nq, pos0, kv_len, meta_ref[TL.META_BT_ROW, tile], j_lo, j_hi, b,
               c_end)


def items_of_block(p, num_blocks: int, num_items: int):
  """How many work items block ``p`` of ``num_blocks`` walks (items ``p, p + P, ...`` below
  ``num_items``): ``ceil((num_items - p) / num_blocks)``, for ``0 <= p < num_blocks``."""
  return lax.div(num_items - p + num_blocks - 1, num_blocks)


def for_each_item(st: KernelStatics, body, init):
  """``carry = body(w, carry)`` over this block's work items ``w = p, p + P, p + 2P, ...``
  (``P = st.grid_size`` blocks, ``st.num_items`` items); returns the final carry."""
  p, num_blocks = lax.axis_index("program"), st.grid_size
  return lax.fori_loop(0, items_of_block(p, num_blocks, st.num_items),
                       lambda k, c: body(p + k * num_blocks, c), init)
