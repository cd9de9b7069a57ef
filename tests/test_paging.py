"""kvjax.paging: allocator, block tables, step metadata and the slot formula vs plain loops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.paging import (BlockAllocator, BlockTables, OutOfBlocksError, StepShapes,
                          build_step_metadata, slot_mapping)
from kv_testing import poisoned_cache, random_kv, spec_for


def test_allocator_against_a_set(rng):
  n = int(rng.integers(8, 40))
  alloc, used = BlockAllocator(n), set()
  for _ in range(200):
    if used and rng.random() < 0.45:
      give = rng.choice(sorted(used), int(rng.integers(1, len(used) + 1)), replace=False)
      alloc.free(give)
      used -= set(give.tolist())
    else:
      k = int(rng.integers(0, 6))
      if k > n - len(used):
        msg = rf"allocate\({k}\): only {n - len(used)} of {n} pages are free"
        with pytest.raises(OutOfBlocksError, match=msg):
          alloc.allocate(k)
      else:
        ids = alloc.allocate(k)
        assert ids.dtype == np.int32 and ids.shape == (k,)
        assert not used & set(ids.tolist()) and all(0 <= i < n for i in ids)
        used |= set(ids.tolist())
    assert alloc.num_free == n - len(used)


def test_allocator_errors_change_nothing():
  alloc = BlockAllocator(4)
  ids = alloc.allocate(3)
  with pytest.raises(OutOfBlocksError, match="only 1 of 4 pages are free"):
    alloc.allocate(2)
  with pytest.raises(ValueError, match="page 3 is not allocated"):
    alloc.free([ids[0], 3])
  with pytest.raises(ValueError, match="outside 0..3"):
    alloc.free([4])
  with pytest.raises(ValueError, match="repeat"):
    alloc.free([ids[1], ids[1]])
  with pytest.raises(TypeError, match="integer page ids"):
    alloc.free(np.array([0.0]))
  with pytest.raises(ValueError, match="n must be an int >= 0"):
    alloc.allocate(-1)
  with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
    BlockAllocator(0)
  assert alloc.num_free == 1
  alloc.free(ids)
  assert alloc.num_free == 4 and sorted(alloc.allocate(4).tolist()) == [0, 1, 2, 3]


def test_block_tables_grow_free_and_fail_atomically(rng):
  bs = 16
  tables = BlockTables(BlockAllocator(10), bs)
  a = int(rng.integers(1, 3 * bs))
  first = tables.reserve("a", a).copy()
  assert len(first) == -(-a // bs)
  grown = tables.reserve("a", a + bs)
  np.testing.assert_array_equal(grown[:len(first)], first)      # growing keeps the old pages
  assert len(grown) == -(-(a + bs) // bs)
  np.testing.assert_array_equal(tables.reserve("a", 1), grown)   # never shrinks
  free_before = tables.allocator.num_free
  too_many = (free_before + 1) * bs
  assert tables.blocks_needed("b", too_many) == free_before + 1
  with pytest.raises(OutOfBlocksError, match="pages are free"):
    tables.reserve("b", too_many)
  assert "b" not in tables and tables.allocator.num_free == free_before
  with pytest.raises(KeyError, match="'b' has no pages"):
    tables.free("b")
  tables.free("a")
  assert len(tables) == 0 and tables.allocator.num_free == 10


def _loop_metadata(shapes, block_lists, cached, new):
  """The step's arrays, one token at a time, straight from the block lists."""
  s_cap, bs = shapes.max_seqs, shapes.block_size
  t_real = sum(new)
  t = s_cap if max(new) == 1 else min(b for b in shapes.token_buckets if b >= t_real)
  out = dict(query_start_loc=[0], seq_lens=[], slot_mapping=[], positions=[], seq_ids=[],
             block_table=np.zeros((s_cap, shapes.max_blocks_per_seq), np.int64))
  for i in range(s_cap):
    c, n = (cached[i], new[i]) if i < len(new) else (0, 0)
    out["query_start_loc"].append(out["query_start_loc"][-1] + n)
    out["seq_lens"].append(c + n)
    for pos in range(c, c + n):
      out["slot_mapping"].append(block_lists[i][pos // bs] * bs + pos % bs)
      out["positions"].append(pos)
      out["seq_ids"].append(i)
    k = -(-(c + n) // bs)
    if k:
      out["block_table"][i, :k] = block_lists[i][:k]
  pad = t - t_real
  out["slot_mapping"] += [-1] * pad
  out["positions"] += [0] * pad
  out["seq_ids"] += [-1] * pad
  return {k: np.asarray(v) for k, v in out.items()}


def _random_schedule(rng, shapes, num_blocks, decode_only=False):
  s = int(rng.integers(1, shapes.max_seqs + 1))
  budget = shapes.token_buckets[-1]
  new = [1] * s if decode_only else [int(rng.integers(1, max(2, budget // s) + 1))
                                     for _ in range(s)]
  cached = [int(rng.integers(0, shapes.max_seq_len - n + 1)) for n in new]
  # each sequence's pages: distinct random ids, sometimes more than it needs
  pages = rng.permutation(num_blocks)
  block_lists, used = [], 0
  for c, n in zip(cached, new):
    k = min(-(-(c + n) // shapes.block_size) + int(rng.integers(0, 2)),
            shapes.max_blocks_per_seq)
    block_lists.append(pages[used:used + k])
    used += k
  return block_lists, cached, new


@pytest.mark.parametrize("decode_only", [False, True])
def test_step_metadata_matches_a_loop(rng, decode_only):
  shapes = StepShapes(block_size=16, max_seqs=int(rng.integers(2, 7)), max_blocks_per_seq=5,
                      token_buckets=(8, 32, 64))
  for _ in range(20):
    lists, cached, new = _random_schedule(rng, shapes, 64, decode_only)
    with jax.transfer_guard("disallow"):          # host side only: no device transfers
      md = build_step_metadata(shapes, lists, cached, new)
    want = _loop_metadata(shapes, lists, cached, new)
    for name, arr in md.arrays().items():
      assert isinstance(arr, np.ndarray) and arr.dtype == np.int32, name
      np.testing.assert_array_equal(arr, want[name], err_msg=name)
    assert (md.num_tokens, md.num_seqs) == (sum(new), len(new))
    if decode_only:
      assert md.max_query_len == 1 and md.positions.shape == (shapes.max_seqs,)
    else:
      assert md.max_query_len == min(b for b in shapes.query_len_buckets if b >= max(new))


def test_slot_mapping_under_jit_matches_a_loop(rng):
  bs, s, m, t = 16, 5, 4, 40
  table = rng.integers(0, 100, (s, m)).astype(np.int32)
  seq = rng.integers(-1, s, t).astype(np.int32)                   # -1: padding
  pos = rng.integers(-3, m * bs + 5, t).astype(np.int32)          # some outside the table
  want = [table[q, p // bs] * bs + p % bs if q >= 0 and 0 <= p < m * bs else -1
          for q, p in zip(seq, pos)]
  got = jax.jit(lambda a, b, c: slot_mapping(a, b, c, block_size=bs))(table, seq, pos)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want)
  host = slot_mapping(table, seq, pos, block_size=bs)
  assert isinstance(host, np.ndarray)
  np.testing.assert_array_equal(host, want)


def test_metadata_drives_write_and_attention(rng):
  """Pages written and read by a built step give dense causal attention over the raw K/V."""
  spec = spec_for("auto", num_kv_heads=2, head_size=32, dtype=jnp.float32)
  shapes = StepShapes(block_size=16, max_seqs=4, max_blocks_per_seq=4, token_buckets=(32, 64))
  num_blocks, hq = 24, 4
  lists, cached, new = _random_schedule(rng, shapes, num_blocks)
  lens = [c + n for c, n in zip(cached, new)]
  # the prefixes go in first, through the same builder (one chunk per sequence)
  k_all, v_all = random_kv(rng, spec, sum(lens))
  k_all, v_all = np.asarray(k_all), np.asarray(v_all)
  starts = np.cumsum([0] + lens)
  cache = poisoned_cache(rng, spec, num_blocks)
  pre = [i for i, c in enumerate(cached) if c]
  if pre:
    big = StepShapes(block_size=16, max_seqs=4, max_blocks_per_seq=4, token_buckets=(256,))
    md0 = build_step_metadata(big, [lists[i] for i in pre], [0] * len(pre),
                              [cached[i] for i in pre])
    rows = np.concatenate([np.arange(starts[i], starts[i] + cached[i]) for i in pre])
    pad = md0.slot_mapping.shape[0] - rows.size
    kk = np.concatenate([k_all[rows], np.zeros((pad,) + k_all.shape[1:], np.float32)])
    vv = np.concatenate([v_all[rows], np.zeros((pad,) + v_all.shape[1:], np.float32)])
    cache = kvjax.write_kv(cache, jnp.asarray(kk), jnp.asarray(vv), md0.slot_mapping, spec)
  md = build_step_metadata(shapes, lists, cached, new)
  rows = np.concatenate([np.arange(starts[i] + c, starts[i + 1]) for i, c in enumerate(cached)])
  pad = md.slot_mapping.shape[0] - rows.size
  k_new = np.concatenate([k_all[rows], rng.standard_normal((pad,) + k_all.shape[1:])])
  v_new = np.concatenate([v_all[rows], rng.standard_normal((pad,) + k_all.shape[1:])])
  cache = kvjax.write_kv(cache, jnp.asarray(k_new, jnp.float32), jnp.asarray(v_new, jnp.float32),
                         md.slot_mapping, spec)
  q = rng.standard_normal((md.slot_mapping.shape[0], hq, spec.head_size)).astype(np.float32)
  meta = {k: jnp.asarray(getattr(md, k)) for k in ("query_start_loc", "seq_lens", "block_table")}
  out = kvjax.unified_attention(jnp.asarray(q), cache, spec, scale=0.2, impl="reference",
                                max_query_len=md.max_query_len, **meta)
  out = np.asarray(out, np.float64)
  g = hq // spec.num_kv_heads
  for tok in range(md.slot_mapping.shape[0]):
    i = md.seq_ids[tok]
    if i < 0:
      assert np.all(out[tok] == 0)                  # padding rows are zero
      continue
    keys = slice(starts[i], starts[i] + md.positions[tok] + 1)
    k = np.repeat(k_all[keys].astype(np.float64), g, axis=1)
    v = np.repeat(v_all[keys].astype(np.float64), g, axis=1)
    sc = np.einsum("hd,lhd->hl", q[tok], k) * 0.2
    w = np.exp(sc - sc.max(-1, keepdims=True))
    want = np.einsum("hl,lhd->hd", w / w.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(out[tok], want, rtol=0, atol=1e-5 * np.abs(v).max())


def test_step_metadata_errors():
  shapes = StepShapes(block_size=16, max_seqs=2, max_blocks_per_seq=2, token_buckets=(8, 16))
  cases = [
      (([[0]] * 3, [0] * 3, [1] * 3), "3 sequences in a step > max_seqs=2"),
      (([[0, 1]], [0], [17]), r"num_tokens=17 exceeds the largest bucket 16"),
      (([[0, 1]], [30], [3]), "sequence 0 has 33 tokens > max_blocks_per_seq 2"),
      (([[0]], [10], [7]), "sequence 0 needs 2 pages for 17 tokens, its block list has 1"),
      (([[0]], [0], [0]), r"num_new\[0\] must be an int >= 1"),
      (([[0]], [-1], [1]), r"num_cached\[0\] must be an int >= 0"),
      (([[0], [1]], [0], [1, 1]), "one entry per sequence"),
  ]
  for args, msg in cases:
    with pytest.raises(ValueError, match=msg):
      build_step_metadata(shapes, *args)
  with pytest.raises(ValueError, match="token_buckets must be a non-empty strictly increasing"):
    StepShapes(block_size=16, max_seqs=2, max_blocks_per_seq=2, token_buckets=(16, 8))
  with pytest.raises(ValueError, match="max_seqs must be an int >= 1"):
    StepShapes(block_size=16, max_seqs=0, max_blocks_per_seq=2, token_buckets=(8,))
  with pytest.raises(ValueError, match=r"max_query_len=9 exceeds the largest bucket 8"):
    StepShapes(16, 2, 2, token_buckets=(16,), query_len_buckets=(4, 8)).query_len_bucket(9)
  with pytest.raises(ValueError, match=r"block_table \[S, max_blocks\], seq_ids \[T\]"):
    slot_mapping(np.zeros((2, 2), np.int32), np.zeros(3, np.int32), np.zeros(2, np.int32),
                 block_size=16)
  with pytest.raises(TypeError, match="positions must have an integer dtype"):
    slot_mapping(np.zeros((2, 2), np.int32), np.zeros(3, np.int32), np.zeros(3), block_size=16)
