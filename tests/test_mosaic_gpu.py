"""Mosaic GPU ragged attention (pallas_kernels.mosaic_gpu), everything a CPU can check.

* tile geometry and per-tile metadata against brute force (pure Python / jnp);
* lowering to Mosaic GPU IR for CUDA with ``jax.export(platforms=["cuda"])``: the Pallas ->
  Mosaic GPU lowering (TMA boxes, wgmma shapes, shared-memory transforms, barriers) runs on
  CPU, only PTX compilation needs the GPU;
* numerics against ``kvjax.reference.unified_attention`` on poisoned caches: in Mosaic GPU
  interpret mode (warpgroups as threads, simulated TMA and barriers; jax >= 0.11, jax 0.10.2's
  interpreter lacks out-of-bounds TMA reads and transposed wgmma operands, so CI on 0.10.2
  skips them), compiled on an sm90+ GPU with ``KVJAX_TEST_COMPILED=1``.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvjax
from kvjax.reference import unified_attention as ref_attention
from kvjax.reference import write_kv
from kv_testing import shuffled_block_table
from op_suite import COMPILED, mosaic_gpu_numerics
from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu.ragged_attention import (ragged_paged_attention,
                                                        ragged_paged_attention_tiled,
                                                        spec_reason, supports_attention)


# -- tile geometry -----------------------------------------------------------------------------
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("max_query_len", [1, 8, 32, 4096])
def test_geometry_slabs_cover_each_head_once(head_size, max_query_len):
  for group in range(1, TL.max_group(head_size) + 1):
    geo = TL.choose_geometry(group, head_size, 16, max_query_len)
    assert geo.bq >= TL.MIN_BQ and geo.bq & (geo.bq - 1) == 0
    assert geo.group * geo.bq <= geo.rows
    assert geo.smem_bytes(head_size, 2) <= TL.SMEM_BUDGET
    seen = set()
    for wg in range(geo.num_wgs):
      rows = set()
      for sl in geo.slabs(wg):
        assert sl.row % 8 == 0 and sl.n % 8 == 0 and sl.row + sl.n <= TL.WG_ROWS
        assert not rows & set(range(sl.row, sl.row + sl.n))
        rows |= set(range(sl.row, sl.row + sl.n))
        seen |= {(sl.g, t) for t in range(sl.tok, sl.tok + sl.n)}
    assert seen == {(g, t) for g in range(group) for t in range(geo.bq)}, (group, geo)


@pytest.mark.parametrize("pv", TL.PV_VARIANTS)
def test_geometry_fits_shared_memory_with_each_pv_variant(pv):
  for head_size in (64, 128, 256):
    for group in range(1, TL.max_group(head_size) + 1):
      geo = TL.choose_geometry(group, head_size, 16, 4096, pv=pv)
      assert geo.smem_bytes(head_size, 2, pv) <= TL.SMEM_BUDGET, (pv, geo)
      assert geo.smem_bytes(head_size, 2, pv) >= geo.smem_bytes(head_size, 2, TL.PV_REGS)


def test_pv_variant_is_checked():
  spec = kvjax.KVCacheSpec(2, 64, 16, dtype=jnp.bfloat16)
  i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
  args = dict(query_start_loc=i32(2), seq_lens=i32(1), block_table=i32((1, 4)), scale=0.1)
  with pytest.raises(ValueError, match="pv must be one of"):
    ragged_paged_attention(jnp.zeros((4, 4, 64), jnp.bfloat16), spec.allocate(4), spec,
                           pv="p_magic", **args)


def test_geometry_pieces_never_straddle_a_page():
  for block_size in (16, 32, 48, 64, 80, 128, 256):
    geo = TL.choose_geometry(4, 128, block_size, 512)
    assert block_size % geo.piece == 0 and geo.block_kv % geo.piece == 0


def test_geometry_rejects_bad_groups():
  with pytest.raises(ValueError, match="GQA group size 17"):
    TL.choose_geometry(17, 128, 16, 64)
  with pytest.raises(ValueError, match="GQA group size 9"):
    TL.choose_geometry(9, 256, 16, 64)


# -- per-tile metadata -------------------------------------------------------------------------
def _random_batch_meta(rng):
  num_seqs = int(rng.integers(1, 7))
  q_lens = rng.integers(0, 40, num_seqs) * (rng.random(num_seqs) < 0.8)
  ctx = rng.integers(0, 100, num_seqs)
  pad = int(rng.integers(0, 20))
  t = int(q_lens.sum()) + pad
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q_lens, ctx, t, qsl, (q_lens + ctx).astype(np.int32)


@pytest.mark.parametrize("bq", [8, 64])
def test_tile_metadata_covers_every_token_once(rng, bq):
  for _ in range(3):
    q_lens, ctx, t, qsl, seq_lens = _random_batch_meta(rng)
    if t == 0:
      continue
    num_tiles = TL.num_tiles_bound(t, len(q_lens), bq)
    meta = np.asarray(jax.jit(TL.tile_metadata, static_argnums=(2, 3, 4, 5))(   # one compile
        jnp.asarray(qsl), jnp.asarray(seq_lens), 9, t, num_tiles, bq))
    assert meta.shape == (TL.META_ROWS, num_tiles)
    owner = -np.ones(t, np.int64)
    for j in range(num_tiles):
      tok0, nq, pos0, kv_len, bt_row = meta[:, j]
      assert 0 <= nq <= bq
      for i in range(nq):
        tok = tok0 + i
        assert owner[tok] < 0, f"token {tok} in two tiles"
        owner[tok] = j
        s = np.searchsorted(qsl[1:], tok, side="right")
        if s < len(q_lens):                         # a real token: its position and keys
          assert pos0 + i == seq_lens[s] - q_lens[s] + (tok - qsl[s])
          assert kv_len == seq_lens[s] and bt_row == 9 * s
        else:                                       # padding: a tile with no keys
          assert kv_len == 0
    assert (owner >= 0).all(), "every token, padding included, has a tile"


# -- support checks ----------------------------------------------------------------------------
def test_supports_attention_reasons():
  bf = jnp.bfloat16
  ok = kvjax.KVCacheSpec(8, 128, 16, dtype=bf)
  assert spec_reason(ok, bf) is None
  assert spec_reason(kvjax.KVCacheSpec(8, 128, 16, layout="HND", dtype=bf), bf) is None
  assert "head_size=80" in spec_reason(kvjax.KVCacheSpec(8, 80, 16, dtype=bf), bf)
  fp8 = kvjax.KVCacheSpec(8, 128, 16, "fp8", dtype=bf)
  assert spec_reason(fp8, bf) is None                  # read through a plain copy of its pages
  assert "q dtype float32" in spec_reason(fp8, jnp.float32)
  assert "float32" in spec_reason(kvjax.KVCacheSpec(8, 128, 16, dtype=jnp.float32),
                                  jnp.float32)
  assert "differs" in spec_reason(ok, jnp.float16)
  assert "GQA group 20" in spec_reason(ok, bf, group=20)
  assert "KVCacheSpec" in spec_reason("NHD", bf)
  reason = supports_attention(ok, bf)
  if jax.default_backend() == "cpu":           # no sm90 GPU here: a reason
    assert isinstance(reason, str) and reason


def test_bad_input_is_named():
  spec = kvjax.KVCacheSpec(2, 64, 16, dtype=jnp.bfloat16)
  cache = spec.allocate(4)
  i32 = functools.partial(jnp.zeros, dtype=jnp.int32)
  args = dict(query_start_loc=i32(2), seq_lens=i32(1), block_table=i32((1, 4)), scale=0.1)
  with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
    ragged_paged_attention(jnp.zeros((4, 3, 64), jnp.bfloat16), cache, spec, **args)
  with pytest.raises(ValueError, match="GQA group 17"):
    ragged_paged_attention(jnp.zeros((4, 34, 64), jnp.bfloat16), cache, spec, **args)
  with pytest.raises(ValueError, match="max_query_len"):
    ragged_paged_attention(jnp.zeros((4, 4, 64), jnp.bfloat16), cache, spec, max_query_len=0,
                           **args)


# -- lowering for CUDA -------------------------------------------------------------------------
LOWER_CASES = [
    # layout, G, D, T, max_query_len, kwargs
    ("NHD", 4, 128, 64, 4096, dict(sliding_window=64, soft_cap=30.0, sinks=True)),
    ("HND", 7, 64, 37, 32, {}),               # T not a multiple of 8: q padded
    ("NHD", 1, 256, 64, 128, dict(causal=False)),
    ("HND", 8, 128, 13, 1, {}),               # decode bucket: one consumer warpgroup
]


def _lower_params():
  """Every P.V variant on the first case, the default one on every case; the other
  (case, variant) pairs in the slow tier (each lowering costs ~2 s of CPU)."""
  for i, case in enumerate(LOWER_CASES):
    for pv in TL.PV_VARIANTS:
      slow = i > 0 and pv != TL.DEFAULT_PV
      yield pytest.param(*case, pv, id=f"{case[0]}-G{case[1]}-D{case[2]}-T{case[3]}-{pv}",
                         marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("layout,group,head_size,num_tokens,max_query_len,kw,pv",
                         list(_lower_params()))
def test_lowers_to_mosaic_gpu_for_cuda(layout, group, head_size, num_tokens, max_query_len, kw,
                                       pv):
  """Lowered as the GPU runs it: persistent blocks (3 here, fewer than the work items, as the
  device's SM count is on real batches) walking their items."""
  spec = kvjax.KVCacheSpec(2, head_size, 16, layout=layout, dtype=jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  q = jax.ShapeDtypeStruct((num_tokens, 2 * group, head_size), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct(spec.physical_shape(32), jnp.bfloat16)
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.zeros(2 * group, jnp.float32)

  def f(q, c, qsl, sl, bt):
    return ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                        block_table=bt, scale=0.1, max_query_len=max_query_len,
                                        pv=pv, num_programs=3, **kw)
  text = export.export(jax.jit(f), platforms=["cuda"])(q, cache, i32(5), i32(4),
                                                         i32(4, 8)).mlir_module()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("staging", TL.STAGINGS)
def test_lowers_with_each_staging(staging):
  """q and the output through each staging buffer (tiles.STAGINGS) on 3 persistent blocks; a
  ragged batch, so output stores start at rows that are not multiples of 8."""
  spec = kvjax.KVCacheSpec(2, 128, 16, dtype=jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def f(q, c, qsl, sl, bt):
    return ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                        block_table=bt, scale=0.1, max_query_len=64,
                                        num_programs=3, staging=staging)
  text = export.export(jax.jit(f), platforms=["cuda"])(
      jax.ShapeDtypeStruct((77, 8, 128), jnp.bfloat16),
      jax.ShapeDtypeStruct(spec.physical_shape(32), jnp.bfloat16), i32(5), i32(4),
      i32(4, 8)).mlir_module()
  assert "mosaic_gpu" in text


def test_lowers_with_a_traced_softmax_scale():
  """A scale traced under jit is read by the kernel from an operand (no float() of a tracer)."""
  spec = kvjax.KVCacheSpec(2, 128, 16, dtype=jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def f(q, c, qsl, sl, bt, scale):
    return ragged_paged_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                                  scale=scale, max_query_len=64)
  text = export.export(jax.jit(f), platforms=["cuda"])(
      jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16),
      jax.ShapeDtypeStruct(spec.physical_shape(32), jnp.bfloat16), i32(5), i32(4), i32(4, 8),
      jax.ShapeDtypeStruct((), jnp.float32)).mlir_module()
  assert "mosaic_gpu" in text


def test_register_split_is_checked_and_reaches_the_kernel():
  """The default split is what the kernel always set (two consumers 232, one 240; the
  producer 40); a chosen split reaches both warpgroups' set_max_registers; a split off the
  multiples of 8 or over the launch's registers is named."""
  from pallas_kernels.mosaic_gpu import kernel_statics as KS
  assert KS.default_registers(2) == (232, 40) and KS.default_registers(1) == (240, 40)
  for wgs in (1, 2):
    consumer, producer = KS.default_registers(wgs)
    assert wgs * consumer + producer <= KS.register_budget(wgs)
  spec = kvjax.KVCacheSpec(2, 128, 16, dtype=jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def jaxpr_text(registers):
    def f(q, c, qsl, sl, bt):
      return ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                          block_table=bt, scale=0.1, max_query_len=64,
                                          num_programs=3, registers=registers)
    return str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((77, 8, 128), jnp.bfloat16),
                                 jax.ShapeDtypeStruct(spec.physical_shape(32), jnp.bfloat16),
                                 i32(5), i32(4), i32(4, 8)))

  def register_counts(text):
    """{action: [registers]} of the set_max_registers in a jaxpr's text: an operand on jax
    0.10 (``[action=increase] 232:``), a parameter on 0.11 (``[action=increase n=232]``)."""
    found = re.findall(r"set_max_registers_p\[action=(\w+)(?:\] | n=)(\d+)", text)
    return {a: sorted({int(n) for b, n in found if b == a}) for a in ("increase", "decrease")}
  for registers, (up, down) in [(None, (232, 40)), ((240, 24), (240, 24))]:
    assert register_counts(jaxpr_text(registers)) == {"increase": [up], "decrease": [down]}
  with pytest.raises(ValueError, match=r"multiples of 8 in \[24, 256\], got \(244, 24\)"):
    jaxpr_text((244, 24))
  with pytest.raises(ValueError, match="need 520 a thread .* the launch gives 504"):
    jaxpr_text((248, 24))


# -- TMA alignment ---------------------------------------------------------------------------
def _gmem_to_smem_copies(closed_jaxpr):
  """(source shape, lands in a tiled buffer) of every GMEM -> SMEM copy in the traced kernel."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "copy_gmem_to_smem":
        tiled = "tiling" in str(eqn.params["dst_transforms_treedef"]).lower()
        found.append((tuple(eqn.invars[0].aval.shape), tiled))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)
  walk(closed_jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("staging", TL.STAGINGS)
@pytest.mark.parametrize("layout,group,head_size,num_tokens,max_query_len",
                         [("NHD", 4, 64, 37, 32), ("HND", 1, 128, 200, 256)])
def test_q_never_lands_in_tiled_shared_memory(layout, group, head_size, num_tokens,
                                              max_query_len, staging):
  """A TMA copy into a tiled buffer addresses global memory in 8-row tiles: a q tile starting
  at a token that is not a multiple of 8 lost the rows past the first tile boundary (zeros,
  compiled only; interpret mode does not model it). q must go through untiled memory; only
  K/V pieces (multiples of 8 tokens, page-aligned) may be copied into tiled buffers."""
  spec = kvjax.KVCacheSpec(2, head_size, 16, layout=layout, dtype=jnp.bfloat16)
  q = jax.ShapeDtypeStruct((num_tokens, 2 * group, head_size), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct(spec.physical_shape(32), jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def f(q, c, qsl, sl, bt):
    return ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                        block_table=bt, scale=0.1,
                                        max_query_len=max_query_len, staging=staging)
  copies = _gmem_to_smem_copies(jax.make_jaxpr(f)(q, cache, i32(5), i32(4), i32(4, 8)))
  geo = TL.choose_geometry(group, head_size, 16, max_query_len)
  sites = 1 if staging == TL.STAGING_PLAIN else head_size // 64    # swizzled: 64-col chunks
  q_copies = [tiled for shape, tiled in copies if shape == q.shape]
  kv_copies = [tiled for shape, tiled in copies if shape == cache.shape]
  assert len(q_copies) == sites * sum(len(geo.slabs(w)) for w in range(geo.num_wgs))
  assert not any(q_copies), "q is copied into a tiled buffer at an arbitrary token start"
  assert len(kv_copies) == 2 * geo.pieces_per_step and all(kv_copies)   # K and V, each piece
  assert len(copies) == len(q_copies) + len(kv_copies)
  assert geo.piece % TL.MIN_BQ == 0 and spec.block_size % geo.piece == 0


@pytest.mark.parametrize("num_items,num_programs", [(1, 0), (7, 3), (264, 132), (4100, 132),
                                                    (5, 132)])
def test_persistent_blocks_walk_every_item_once(num_items, num_programs):
  """Block p of the grid walks items p, p + P, ...: together every item exactly once."""
  from pallas_kernels.mosaic_gpu import kernel_statics as KS
  from pallas_kernels.mosaic_gpu import work_items as WI
  st = KS.KernelStatics(geo=TL.choose_geometry(4, 128, 16, 64), head_size=128, num_kv_heads=1,
                       layout="NHD", num_blocks=8, max_blocks=4, num_tiles=num_items,
                       causal=True, window=None, soft_cap=None, has_sinks=False, scale=0.1,
                       dtype=np.dtype(jnp.bfloat16), num_programs=num_programs)
  grid = st.grid_size
  assert grid == min(num_programs or num_items, num_items)
  walked = [p + k * grid for p in range(grid)
            for k in range(int(WI.items_of_block(p, grid, st.num_items)))]
  assert sorted(walked) == list(range(num_items))


@pytest.mark.parametrize("group,head_size,max_query_len,q_own", [
    (4, 128, 4096, True), (1, 128, 4096, True), (4, 256, 128, True), (7, 64, 32, True),
    (8, 128, 1, False)])        # decode bucket: the buffer would take one of its 3 K/V slots
def test_q_gets_its_own_buffer_only_where_it_takes_no_kv_slot(group, head_size,
                                                              max_query_len, q_own):
  """q gets a staging buffer of its own exactly where it fits next to the K/V slots the tile
  would have anyway (choose_geometry does not count it); else it shares the output's, swizzled
  all the same; interpret mode stages plainly."""
  geo = TL.choose_geometry(group, head_size, 16, max_query_len)
  staging = TL.choose_staging(geo, head_size)
  assert staging == (TL.STAGING_Q_OWN if q_own else TL.STAGING_SWIZZLED)
  assert geo.smem_bytes(head_size, 2, staging=staging) <= TL.SMEM_BUDGET
  if not q_own:
    assert geo.smem_bytes(head_size, 2, staging=TL.STAGING_Q_OWN) > TL.SMEM_BUDGET
  assert TL.choose_staging(geo, head_size, interpret=True) == TL.STAGING_PLAIN


def test_geometry_rejects_pieces_off_the_8_row_tiles():
  """(KVCacheSpec already takes multiples of 16 only; a hand-made geometry is checked too.)"""
  with pytest.raises(ValueError, match="block_size=12"):
    TL.choose_geometry(4, 128, 12, 64)
  with pytest.raises(ValueError, match="block_size=20"):
    TL.TileGeometry(4, 32, 2, 128, 2, 20)
  assert TL.TileGeometry(4, 32, 2, 128, 2, 24).piece == 8


# -- numerics: interpret mode, or compiled with KVJAX_TEST_COMPILED=1 --------------------------


def _nan_poisoned_batch(rng, spec, hq, q_lens, ctx_lens, pad):
  """(q, cache, qsl, seq_lens, block_table): shuffled pages, every slot no token was written
  to (unreferenced pages, tails of last pages) NaN."""
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(ctx_lens)
  bt, num_blocks = shuffled_block_table(rng, -(-seq_lens // n), spare=3, unused="spare")
  shape = spec.physical_shape(num_blocks)
  cache = jnp.asarray(np.full(shape, np.nan, np.float32)).astype(spec.storage_dtype)
  slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                          for s, L in enumerate(seq_lens)]).astype(np.int32)
  kv_shape = (len(slots), spec.num_kv_heads, spec.head_size)
  k, v = (jnp.asarray(rng.standard_normal(kv_shape), spec.dtype) for _ in range(2))
  cache = write_kv(cache, k, v, jnp.asarray(slots), spec)
  q = jnp.asarray(rng.standard_normal((int(np.sum(q_lens)) + pad, hq, spec.head_size)),
                  spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


NUMERICS_CASES = [
    # layout, H, G, D, N, q_lens, ctx_lens, pad, max_query_len, kwargs ("stages": force the
    # number of K/V slots, so that tiles with more key steps than slots reuse them;
    # "programs": CUDA blocks, fewer than work items, so that each walks several of them and
    # its slots and barriers carry over from item to item)
    ("NHD", 1, 2, 64, 16, [40, 1], [300, 290], 0, 64, dict(stages=2, programs=1)),
    ("NHD", 1, 4, 64, 16, [20, 1, 0, 9], [0, 40, 8, 17], 3, 32, dict(programs=2)),
    ("HND", 1, 7, 64, 32, [18, 1, 5], [3, 70, 0], 2, 32,
     dict(sliding_window=20, soft_cap=5.0, sinks=True)),
    ("NHD", 2, 1, 64, 48, [150, 3], [0, 30], 1, 256, dict(sliding_window=50)),
    ("HND", 1, 2, 64, 16, [40, 2], [10, 100], 0, 64, dict(causal=False)),
    # q in a staging buffer of its own (the compiled default where it fits), swizzled, on
    # blocks that walk several items with surplus tiles between them
    ("NHD", 1, 4, 64, 16, [20, 1, 0, 9], [0, 40, 8, 17], 3, 32,
     dict(programs=2, staging=TL.STAGING_Q_OWN)),
]


@mosaic_gpu_numerics
@pytest.mark.parametrize("layout,h,group,head_size,block_size,q_lens,ctx_lens,pad,mql,kw",
                         NUMERICS_CASES)
def test_kernel_matches_reference(rng, layout, h, group, head_size, block_size, q_lens,
                                  ctx_lens, pad, mql, kw):
  spec = kvjax.KVCacheSpec(h, head_size, block_size, layout=layout, dtype=jnp.bfloat16)
  q, cache, qsl, sl, bt = _nan_poisoned_batch(rng, spec, h * group, q_lens, ctx_lens, pad)
  kw = dict(kw, scale=head_size ** -0.5)
  geo = TL.choose_geometry(group, head_size, block_size, mql)
  if "stages" in kw:
    geo = dataclasses.replace(geo, stages=kw.pop("stages"))
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(h * group) * 2, jnp.float32)
  programs = kw.pop("programs", 0)
  staging = kw.pop("staging", None)
  out = ragged_paged_attention_tiled(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                     block_table=bt, max_query_len=mql, interpret=not COMPILED,
                                     geometry=geo, num_programs=programs, staging=staging,
                                     **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  o = np.asarray(out, np.float32)
  r = np.asarray(jax.jit(functools.partial(ref_attention, spec=spec, **kw))(
      q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt), np.float32)
  real = int(qsl[-1])
  assert np.all(o[real:] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(r).all() and np.isfinite(o).all()
  # bf16 output of a float32 computation: a few bf16 ulps of the output's magnitude.
  np.testing.assert_allclose(o, r, atol=2e-2 * np.abs(r).max(), rtol=2e-2)
