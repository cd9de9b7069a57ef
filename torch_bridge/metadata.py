"""Per-step attention metadata with vLLM's field names (torch tensors)."""
from __future__ import annotations

import dataclasses

import torch

from kvjax import validation as V
from torch_bridge import checks
from torch_bridge import jitted


@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
  """One scheduler step's batch description, shared by every layer.

  Attributes:
    query_start_loc: int32 ``[S+1]``, cumulative query lengths (starts at 0).
    seq_lens: int32 ``[S]``, KV length of each sequence (prefix + new tokens).
    block_table: int32 ``[S, max_blocks]``, page ids of each sequence.
    slot_mapping: int32 or int64 ``[T]``, cache slot of each new token (-1 = skip).
    max_query_len: the longest query of the step (Python int; 1 = a pure decode).
    max_seq_len: the longest KV length of the step (Python int).
    causal: decoder self-attention (vLLM's default).

  The facade checks the values (CPU tensors; CUDA ones with
  ``check_cuda_inputs=True``), pads them to shape buckets (:meth:`padded`) and imports
  them into JAX once per metadata object (on the first layer that uses it) and reuses
  all of it for the other layers: treat the tensors as read-only once the metadata is
  built, as vLLM does within a step. int64 values are narrowed to int32 by
  saturation, never wrapped.
  """
  query_start_loc: torch.Tensor
  seq_lens: torch.Tensor
  block_table: torch.Tensor
  slot_mapping: torch.Tensor
  max_query_len: int
  max_seq_len: int
  causal: bool = True

  def __post_init__(self):
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
      t = getattr(self, name)
      if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
      if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    want = {"query_start_loc": 1, "seq_lens": 1, "block_table": 2, "slot_mapping": 1}
    for name, nd in want.items():
      if getattr(self, name).ndim != nd:
        raise ValueError(f"{name} must be {nd}-D, got shape {tuple(getattr(self, name).shape)}")
    s = self.seq_lens.shape[0]
    if self.query_start_loc.shape[0] != s + 1 or self.block_table.shape[0] != s:
      raise ValueError(f"query_start_loc [S+1], seq_lens [S], block_table [S, M] disagree: "
                       f"{tuple(self.query_start_loc.shape)}, {tuple(self.seq_lens.shape)}, "
                       f"{tuple(self.block_table.shape)}")
    for name in ("max_query_len", "max_seq_len"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    object.__setattr__(self, "_jax", {})
    object.__setattr__(self, "_padded", {})
    object.__setattr__(self, "_checked", set())

  def check_values(self, num_tokens: int, num_blocks: int, block_size: int, on_cuda: bool):
    """kvjax's host checks of the values (``kvjax.validation.check_attention_metadata``) for
    ``num_tokens`` query tokens over a cache of ``num_blocks`` blocks, once per configuration.
    CUDA tensors are read (a sync) only if ``on_cuda``; without it there is nothing to check,
    and that too is decided once per configuration."""
    key = (num_tokens, num_blocks, block_size, on_cuda)
    if key in self._checked:
      return
    values = [checks.host_values(getattr(self, n), on_cuda)
              for n in ("query_start_loc", "seq_lens", "block_table")]
    if all(v is not None for v in values):
      V.check_attention_metadata(*values, num_tokens=num_tokens, num_blocks=num_blocks,
                                 block_size=block_size, max_query_len=self.max_query_len)
    self._checked.add(key)

  def int32_tensors(self):
    """``(query_start_loc, seq_lens, block_table)`` as int32 contiguous tensors (the
    metadata's own when they are; else converted once per metadata object)."""
    got = self._padded.get("int32")
    if got is None:
      got = self._padded["int32"] = tuple(
          checks.saturate_int32(getattr(self, n)).contiguous()
          for n in ("query_start_loc", "seq_lens", "block_table"))
    return got

  def padded(self, num_tokens: int):
    """``(query_start_loc, seq_lens, block_table, max_query_len bucket)`` for T query rows.

    int32 torch tensors on the metadata's device, padded so that a serving run compiles
    few programs (:mod:`torch_bridge.jitted`'s buckets): sequences up to
    ``num_seqs_bucket(S, T)`` with zero-length entries (``query_start_loc`` repeats its
    last value, ``seq_lens`` 0: no query row, no KV read), block-table columns up to
    ``table_width_bucket(M)`` (block 0, never read). Built once per T (torch ops on the
    tensors' stream); the unpadded tensors are returned as they are when no padding is due.
    """
    got = self._padded.get(num_tokens)
    if got is not None:
      return got
    qsl, sl, bt = (checks.saturate_int32(getattr(self, n))
                   for n in ("query_start_loc", "seq_lens", "block_table"))
    s, m = bt.shape
    extra_s = jitted.num_seqs_bucket(s, num_tokens) - s
    extra_m = jitted.table_width_bucket(m) - m
    if extra_s:
      qsl = torch.cat([qsl, qsl[-1:].expand(extra_s)])
      sl = torch.nn.functional.pad(sl, (0, extra_s), value=0)
    if extra_s or extra_m:
      bt = torch.nn.functional.pad(bt, (0, extra_m, 0, extra_s), value=0)
    got = (qsl, sl, bt, jitted.query_len_bucket(self.max_query_len, num_tokens))
    self._padded[num_tokens] = got
    return got

  def jax_arrays(self, crossing, num_tokens: int):
    """The :meth:`padded` tensors for T query rows as JAX arrays, imported once per device.

    Call :meth:`padded` before the crossing's fence (the padding is torch work the
    imports must be ordered after)."""
    key = (crossing.device, crossing.mode, num_tokens)
    arrays = self._jax.get(key)
    if arrays is None:
      arrays = tuple(crossing.fresh(t) for t in self.padded(num_tokens)[:3])
      self._jax[key] = arrays
    return arrays
