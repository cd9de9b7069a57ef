"""Paging for a serving loop: pages, block tables and one ragged step's metadata.

Host side (numpy only, nothing touches a device):

* :class:`BlockAllocator` hands out and takes back page ids of one cache.
* :class:`BlockTables` keeps each sequence's list of pages and grows it on demand.
* :class:`StepShapes` fixes the padded sizes of a step (token buckets, sequence
  and block-table capacities) so that a jitted step compiles a small, fixed set
  of shapes; :func:`build_step_metadata` fills one step's arrays for a mix of
  chunked prefills and decodes.

Both sides:

* :func:`slot_mapping` is the one slot formula
  ``block_table[seq, pos // block_size] * block_size + pos % block_size``: numpy
  in, numpy out on the host; jax arrays (or tracers inside ``jax.jit``) in, jnp out.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Hashable, Optional, Sequence, Tuple

import numpy as np


class OutOfBlocksError(RuntimeError):
  """Raised when an allocation asks for more pages than are free."""


def _count(name, value, *, minimum=0):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def blocks_for(num_tokens: int, block_size: int) -> int:
  """Pages needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
  return -(-num_tokens // block_size)


class BlockAllocator:
  """Free list of the page ids ``0 .. num_blocks - 1`` of one cache.

  Pages freed last are handed out first. Every layer's cache of a model shares one
  allocator: a page id names the same page in each of them.

  >>> alloc = BlockAllocator(4)
  >>> alloc.allocate(3).tolist(), alloc.num_free
  ([0, 1, 2], 1)
  >>> alloc.free([1]); alloc.allocate(2).tolist()
  [1, 3]
  """

  def __init__(self, num_blocks: int):
    self.num_blocks = _count("num_blocks", num_blocks, minimum=1)
    self._free = list(range(self.num_blocks - 1, -1, -1))   # a stack: pop() is the next id
    self._used = np.zeros(self.num_blocks, bool)

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> np.ndarray:
    """``n`` free page ids, int32 ``[n]``.

    Raises :class:`OutOfBlocksError` (taking nothing) when fewer than ``n`` are free.
    """
    n = _count("n", n)
    if n > len(self._free):
      raise OutOfBlocksError(
          f"allocate({n}): only {len(self._free)} of {self.num_blocks} pages are free; free "
          f"finished sequences' pages first or allocate a cache with more blocks")
    ids = [self._free.pop() for _ in range(n)]
    self._used[ids] = True
    return np.asarray(ids, np.int32)

  def free(self, blocks) -> None:
    """Return pages (int ``[n]``) to the free list.

    Raises ValueError (freeing nothing) for an id out of range, repeated or not in use.
    """
    ids = np.asarray(blocks).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f"blocks must be integer page ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= self.num_blocks)]
    if bad.size:
      raise ValueError(f"free(): page id {int(bad[0])} is outside 0..{self.num_blocks - 1}")
    if len(np.unique(ids)) != ids.size:
      raise ValueError(f"free(): page ids repeat in {ids.tolist()}")
    not_used = ids[~self._used[ids]]
    if not_used.size:
      raise ValueError(f"free(): page {int(not_used[0])} is not allocated (freed twice?)")
    self._used[ids] = False
    self._free.extend(int(i) for i in ids[::-1])


class BlockTables:
  """Each sequence's pages, grown on demand from one :class:`BlockAllocator`.

  >>> tables = BlockTables(BlockAllocator(8), block_size=16)
  >>> tables.reserve("a", 20).tolist()        # 20 tokens need 2 pages
  [0, 1]
  >>> tables.reserve("a", 33).tolist(), tables.blocks_needed("b", 16)
  ([0, 1, 2], 1)
  >>> tables.free("a"); tables.allocator.num_free
  8
  """

  def __init__(self, allocator: BlockAllocator, block_size: int):
    self.allocator = allocator
    self.block_size = _count("block_size", block_size, minimum=1)
    self._blocks: Dict[Hashable, np.ndarray] = {}

  def __contains__(self, seq_id) -> bool:
    return seq_id in self._blocks

  def __len__(self) -> int:
    return len(self._blocks)

  def blocks(self, seq_id) -> np.ndarray:
    """The sequence's page ids, int32 ``[num_pages]`` in token order."""
    if seq_id not in self._blocks:
      raise KeyError(f"sequence {seq_id!r} has no pages (reserve() it first)")
    return self._blocks[seq_id]

  def blocks_needed(self, seq_id, num_tokens: int) -> int:
    """Pages ``reserve(seq_id, num_tokens)`` would take from the allocator."""
    have = len(self._blocks.get(seq_id, ()))
    return max(0, blocks_for(_count("num_tokens", num_tokens), self.block_size) - have)

  def reserve(self, seq_id, num_tokens: int) -> np.ndarray:
    """Grow the sequence (new ids start empty) to hold ``num_tokens`` tokens; returns its pages.

    Never shrinks. Raises :class:`OutOfBlocksError` with nothing changed when the
    allocator has too few free pages.
    """
    more = self.blocks_needed(seq_id, num_tokens)
    have = self._blocks.get(seq_id, np.zeros(0, np.int32))
    if more or seq_id not in self._blocks:
      self._blocks[seq_id] = np.concatenate([have, self.allocator.allocate(more)])
    return self._blocks[seq_id]

  def free(self, seq_id) -> None:
    """Give all of a finished sequence's pages back to the allocator and forget it."""
    self.allocator.free(self.blocks(seq_id))
    del self._blocks[seq_id]


@dataclasses.dataclass(frozen=True)
class StepShapes:
  """The padded sizes of every step: what a jitted step function is compiled for.

  Attributes:
    block_size: tokens per page.
    max_seqs: S, sequences per step (fewer are padded with zero-length sequences).
    max_blocks_per_seq: width of the block table ``[S, max_blocks_per_seq]``.
    token_buckets: increasing token counts T a mixed step is padded to (the
      smallest that fits). A pure decode step (one new token per sequence) uses
      T = ``max_seqs`` instead, the decode kernel's shape.
    query_len_buckets: increasing values a step's longest query (new tokens of one
      sequence) is rounded up to; None = powers of two up to the largest token
      bucket. Smaller is enough when prefills are chunked.

  Compiled shapes: at most ``len(token_buckets) * len(query_len_buckets) + 1``.

  >>> shapes = StepShapes(block_size=16, max_seqs=4, max_blocks_per_seq=8, token_buckets=(32, 128))
  >>> shapes.token_bucket(33), shapes.query_len_bucket(5), shapes.max_seq_len
  (128, 8, 128)
  """
  block_size: int
  max_seqs: int
  max_blocks_per_seq: int
  token_buckets: Tuple[int, ...]
  query_len_buckets: Optional[Tuple[int, ...]] = None

  def __post_init__(self):
    for name in ("block_size", "max_seqs", "max_blocks_per_seq"):
      _count(name, getattr(self, name), minimum=1)
    tb = _increasing("token_buckets", self.token_buckets)
    object.__setattr__(self, "token_buckets", tb)
    qb = self.query_len_buckets
    if qb is None:
      qb = tuple(1 << i for i in range(int(tb[-1] - 1).bit_length() + 1))
    object.__setattr__(self, "query_len_buckets", _increasing("query_len_buckets", qb))

  @property
  def max_seq_len(self) -> int:
    """Longest sequence (cached + new tokens) the block table can hold."""
    return self.max_blocks_per_seq * self.block_size

  def token_bucket(self, num_tokens: int) -> int:
    """The smallest token bucket >= num_tokens; ValueError if none is large enough."""
    return _bucket("num_tokens", num_tokens, self.token_buckets)

  def query_len_bucket(self, max_query_len: int) -> int:
    """The smallest query-length bucket >= max_query_len."""
    return _bucket("max_query_len", max_query_len, self.query_len_buckets)


def _increasing(name, values) -> Tuple[int, ...]:
  values = tuple(values)
  if not values or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                       for v in values) or list(values) != sorted(set(values)):
    raise ValueError(f"{name} must be a non-empty strictly increasing tuple of positive ints, "
                     f"got {values!r}")
  return tuple(int(v) for v in values)


def _bucket(name, n, buckets) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]} of {buckets}")


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """One ragged step's metadata, padded to a :class:`StepShapes`; numpy int32 arrays.

  With T the token bucket (``max_seqs`` for a pure decode step) and S = ``max_seqs``.
  Hand :meth:`arrays` to a jitted step as traced arguments and ``max_query_len`` as a
  static one: steps of equal (T, max_query_len) reuse one compiled program.

  Attributes:
    query_start_loc: ``[S+1]``: sequence s's new tokens are rows
      ``query_start_loc[s]:query_start_loc[s+1]`` of the step; padded sequences
      are empty, so ``query_start_loc[S]`` is the number of real tokens.
    seq_lens: ``[S]``: cached prefix + new tokens (0 for padded sequences).
    block_table: ``[S, max_blocks_per_seq]``: page ids, 0 past a sequence's pages.
    slot_mapping: ``[T]``: cache slot of each new token, -1 for padding tokens.
    positions: ``[T]``: absolute position of each new token, 0 for padding.
    seq_ids: ``[T]``: the step's sequence index of each token, -1 for padding.
    num_tokens: real tokens (the rest of T is padding).
    num_seqs: real sequences (the rest of S is padding).
    max_query_len: the longest sequence's new tokens, rounded up to a
      query-length bucket (1 for a pure decode step); pass it to
      ``kvjax.unified_attention`` as a static argument.
  """
  query_start_loc: np.ndarray
  seq_lens: np.ndarray
  block_table: np.ndarray
  slot_mapping: np.ndarray
  positions: np.ndarray
  seq_ids: np.ndarray
  num_tokens: int
  num_seqs: int
  max_query_len: int

  def arrays(self) -> Dict[str, np.ndarray]:
    """The per-step arrays by name (the traced arguments of a jitted step)."""
    return {f: getattr(self, f) for f in ("query_start_loc", "seq_lens", "block_table",
                                          "slot_mapping", "positions", "seq_ids")}


def build_step_metadata(shapes: StepShapes, block_lists: Sequence, num_cached: Sequence[int],
                        num_new: Sequence[int]) -> StepMetadata:
  """Metadata of one step that runs ``num_new[i]`` new tokens of sequence i.

  Args:
    shapes: the padded sizes.
    block_lists: per sequence, its page ids (int ``[n_i]``, e.g.
      ``BlockTables.blocks(seq_id)``); they must hold ``num_cached[i] + num_new[i]`` tokens.
    num_cached: per sequence, tokens already in the cache (positions
      ``0 .. num_cached[i] - 1``); 0 for a fresh prefill.
    num_new: per sequence, tokens this step (>= 1): a prefill chunk or 1 for a decode.
  Sequences keep their order; their tokens are packed in that order.

  >>> shapes = StepShapes(block_size=16, max_seqs=4, max_blocks_per_seq=4, token_buckets=(8, 16))
  >>> md = build_step_metadata(shapes, [[5, 2], [7]], num_cached=[20, 0], num_new=[1, 3])
  >>> md.query_start_loc.tolist(), md.seq_lens.tolist(), md.max_query_len
  ([0, 1, 4, 4, 4], [21, 3, 0, 0], 4)
  >>> md.slot_mapping.tolist()          # page 2 offset 4, page 7 offsets 0..2, padding
  [36, 112, 113, 114, -1, -1, -1, -1]
  >>> md.positions.tolist()
  [20, 0, 1, 2, 0, 0, 0, 0]
  """
  num_cached = [_count(f"num_cached[{i}]", c) for i, c in enumerate(num_cached)]
  num_new = [_count(f"num_new[{i}]", n, minimum=1) for i, n in enumerate(num_new)]
  block_lists = [np.asarray(b).reshape(-1) for b in block_lists]
  s = len(block_lists)
  if not len(num_cached) == len(num_new) == s:
    raise ValueError(f"block_lists, num_cached and num_new must have one entry per sequence, got "
                     f"lengths {s}, {len(num_cached)}, {len(num_new)}")
  if s > shapes.max_seqs:
    raise ValueError(f"{s} sequences in a step > max_seqs={shapes.max_seqs}")
  seq_lens = np.zeros(shapes.max_seqs, np.int32)
  block_table = np.zeros((shapes.max_seqs, shapes.max_blocks_per_seq), np.int32)
  for i, (blocks, cached, new) in enumerate(zip(block_lists, num_cached, num_new)):
    seq_lens[i] = total = cached + new
    if total > shapes.max_seq_len:
      raise ValueError(f"sequence {i} has {total} tokens > max_blocks_per_seq "
                       f"{shapes.max_blocks_per_seq} x block_size {shapes.block_size}")
    need = blocks_for(total, shapes.block_size)
    if blocks.size < need:
      raise ValueError(f"sequence {i} needs {need} pages for {total} tokens, its block list has "
                       f"{blocks.size} (reserve its pages first, e.g. BlockTables.reserve)")
    block_table[i, :need] = blocks[:need]
  t_real = sum(num_new)
  decode = s > 0 and max(num_new) == 1
  t = shapes.max_seqs if decode else shapes.token_bucket(t_real)
  query_start_loc = np.full(shapes.max_seqs + 1, t_real, np.int32)
  query_start_loc[:s + 1] = np.cumsum([0] + num_new)
  seq_ids = np.full(t, -1, np.int32)
  positions = np.zeros(t, np.int32)
  for i, (cached, new) in enumerate(zip(num_cached, num_new)):
    rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
    seq_ids[rows] = i
    positions[rows] = np.arange(cached, cached + new)
  return StepMetadata(
      query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
      slot_mapping=slot_mapping(block_table, seq_ids, positions, block_size=shapes.block_size),
      positions=positions, seq_ids=seq_ids, num_tokens=t_real, num_seqs=s,
      max_query_len=1 if decode else shapes.query_len_bucket(max(num_new, default=1)))


def slot_mapping(block_table, seq_ids, positions, *, block_size: int):
  """Cache slot of each token: ``block_table[seq, pos // bs] * bs + pos % bs`` (bs = block_size).

  Args:
    block_table: int ``[S, max_blocks]``.
    seq_ids: int ``[T]``: each token's row of the block table; negative = padding.
    positions: int ``[T]``: each token's absolute position in its sequence.
    block_size: tokens per page (Python int).
  Returns:
    int32 ``[T]``; -1 for padding tokens and for positions outside
    ``0 .. max_blocks * block_size - 1`` (a write there is skipped, never wrapped).
  With numpy arrays it runs in numpy (host, no device work); with jax arrays or
  under ``jax.jit`` in jnp, e.g. to advance decode positions on the device.

  >>> table, seq_ids, pos = np.array([[3, 1]]), np.array([0, 0, -1]), np.array([15, 16, 0])
  >>> slot_mapping(table, seq_ids, pos, block_size=16).tolist()
  [63, 16, -1]
  """
  block_table, seq_ids, positions = (x if hasattr(x, "ndim") else np.asarray(x)
                                      for x in (block_table, seq_ids, positions))
  if all(isinstance(x, np.ndarray) for x in (block_table, seq_ids, positions)):
    xp = np
  else:
    import jax.numpy as xp
  if block_table.ndim != 2 or seq_ids.ndim != 1 or positions.shape != seq_ids.shape:
    raise ValueError(f"slot_mapping wants block_table [S, max_blocks], seq_ids [T] and positions "
                     f"[T], got shapes {tuple(block_table.shape)}, {tuple(seq_ids.shape)}, "
                     f"{tuple(positions.shape)}")
  for name, x in (("block_table", block_table), ("seq_ids", seq_ids), ("positions", positions)):
    if not xp.issubdtype(x.dtype, xp.integer):
      raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  max_blocks = block_table.shape[1]
  valid = (seq_ids >= 0) & (seq_ids < block_table.shape[0])
  valid &= (positions >= 0) & (positions < max_blocks * block_size)
  seq = xp.where(valid, seq_ids, 0).astype(xp.int32)
  pos = xp.where(valid, positions, 0).astype(xp.int32)
  block = block_table[seq, pos // block_size].astype(xp.int32)
  return xp.where(valid, block * block_size + pos % block_size, -1).astype(xp.int32)
