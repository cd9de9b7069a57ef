"""The ragged batch of ``unified_attention``: which query token belongs to which sequence, at
which position, and what metadata outside the contract does under ``jax.jit``.

The public op rejects invalid *concrete* metadata. Traced metadata cannot be checked without a
host sync, so every implementation (the reference and every kernel) applies the same rules,
written here once:

1. ``query_start_loc`` is clipped to ``[0, T]`` and made non-decreasing (a running maximum):
   ``qsl' = cummax(clip(qsl, 0, T))``. Token ``i`` belongs to sequence ``s`` when
   ``qsl'[s] <= i < qsl'[s+1]``; tokens that belong to no sequence (before ``qsl'[0]``, from
   ``qsl'[S]`` on) output 0.
2. A sequence with more than ``max_query_len`` query tokens outputs 0 for all its tokens.
3. ``seq_lens`` are clipped to ``[0, max_blocks * block_size]`` (the block table's capacity).
   Query token ``j`` of sequence ``s`` sits at position ``seq_len - q_len + j``; under causal
   masking a query at a negative position sees no key and outputs 0.
4. Block-table entries are clipped to ``[0, num_blocks)``.

Every index stays in bounds whatever the metadata holds, so no implementation reads or writes
outside its arrays.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def clamp_metadata(query_start_loc, seq_lens, *, num_tokens: int, capacity: int):
  """Rules 1 and 3: (qsl' int32 ``[S+1]`` non-decreasing in ``[0, T]``, seq_lens int32 ``[S]``
  in ``[0, capacity]``)."""
  qsl = jnp.clip(jnp.asarray(query_start_loc).astype(jnp.int32), 0, num_tokens)
  qsl = jax.lax.cummax(qsl, axis=0)
  return qsl, jnp.clip(jnp.asarray(seq_lens).astype(jnp.int32), 0, capacity)


def clamp_blocks(block_ids, num_blocks: int):
  """Rule 4: block-table entries clipped to ``[0, num_blocks)``, int32."""
  return jnp.clip(block_ids.astype(jnp.int32), 0, num_blocks - 1)


def sequence_of_tokens(query_start_loc, num_tokens: int):
  """Rule 1: the sequence each token belongs to, int32 ``[T]``; ``S`` for tokens of none.

  Reads the raw ``query_start_loc [S+1]``: token ``i``'s sequence is one less than the first
  entry of ``clip(qsl, 0, T)`` above ``i`` (the running maximum first exceeds ``i`` there).
  One comparison per (token, entry) and a min-reduce: a single small XLA fusion.
  """
  num_seqs = query_start_loc.shape[0] - 1
  qc = jnp.clip(jnp.asarray(query_start_loc).astype(jnp.int32), 0, num_tokens)
  i = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
  r = jnp.arange(num_seqs + 1, dtype=jnp.int32)[None, :]
  first_above = jnp.min(jnp.where(qc[None, :] > i, r, num_seqs + 1), axis=1)
  return jnp.where((first_above >= 1) & (first_above <= num_seqs), first_above - 1,
                   num_seqs).astype(jnp.int32)


def token_positions(query_start_loc, seq_lens, num_tokens: int, max_query_len=None):
  """Per query token: (sequence id, absolute position, whether it is a real query row).

  Takes the metadata as :func:`clamp_metadata` returns it (non-decreasing ``[S+1]``,
  ``[S]``). Sequence ids of tokens that are no real row are clipped to ``S - 1`` (in bounds).
  """
  num_seqs = seq_lens.shape[0]
  seq = sequence_of_tokens(query_start_loc, num_tokens)
  real = seq < num_seqs
  seq = jnp.minimum(seq, num_seqs - 1)
  q_len = query_start_loc[seq + 1] - query_start_loc[seq]
  if max_query_len is not None:
    real &= q_len <= max_query_len
  i = jnp.arange(num_tokens, dtype=jnp.int32)
  pos = seq_lens[seq] - q_len + (i - query_start_loc[seq])
  return seq, pos, real


def is_decode_batch(num_tokens: int, num_seqs: int, max_query_len) -> bool:
  """One query token per sequence, known statically (``max_query_len == 1`` and ``T == S``):
  the case the decode kernels take."""
  return max_query_len == 1 and num_tokens == num_seqs


def decode_sequences(query_start_loc, num_tokens: int):
  """Decode batches (``max_query_len == 1``): per token, the sequence whose single query
  it is, int32 ``[T]``, or ``S`` when it is none (rules 1 and 2 for one query per sequence).

  Token ``i`` is sequence ``s``'s query when ``qsl'[s] == i`` and ``qsl'[s+1] == i + 1``.
  Computed from the raw metadata with elementwise ops and min-reduces (one small fusion, no
  running maximum): ``s + 1`` is the first clipped entry above ``i``, which must equal
  ``i + 1``, and the value ``i`` must occur before it.
  """
  num_seqs = query_start_loc.shape[0] - 1
  qc = jnp.clip(jnp.asarray(query_start_loc).astype(jnp.int32), 0, num_tokens)
  i = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
  r = jnp.arange(num_seqs + 1, dtype=jnp.int32)[None, :]
  none = num_seqs + 1
  first_above = jnp.min(jnp.where(qc[None, :] > i, r, none), axis=1)
  first_equal = jnp.min(jnp.where(qc[None, :] == i, r, none), axis=1)
  nxt = jnp.take(qc, jnp.minimum(first_above, num_seqs))
  ok = ((first_above >= 1) & (first_above <= num_seqs) & (first_equal < first_above)
        & (nxt == i[:, 0] + 1))
  return jnp.where(ok, first_above - 1, num_seqs).astype(jnp.int32)
