"""Mosaic GPU paged decode kernel (pallas_kernels.mosaic_gpu.decode), everything a CPU can check.

* geometry: the GQA groups whose queries fit the kernel's 16 query columns, K/V slots that fit
  two blocks per SM, page pieces, the split rule;
* which calls take it: formats with Mosaic GPU hooks, decode batches, the auto rule;
* lowering to Mosaic GPU IR for CUDA with ``jax.export(platforms=["cuda"])`` (TMA boxes, wgmma
  shapes and transposes, shared-memory transforms, cross-warp reductions, barriers);
* numerics against ``kvjax.reference.unified_attention`` on NaN-poisoned caches: in Mosaic
  GPU interpret mode (jax >= 0.11: CI on 0.10.2 skips them), compiled on an sm90+ GPU with
  ``KVJAX_TEST_COMPILED=1`` (``benchmarks/bench_decode.py`` also checks the compiled kernel).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvjax
from kvjax import registry
from kvjax.reference import unified_attention as ref_attention
from kvjax.reference import write_kv
from op_suite import COMPILED, mosaic_gpu_numerics
from pallas_kernels.mosaic_gpu import attention as MA
from pallas_kernels.mosaic_gpu import decode as MD
from pallas_kernels.mosaic_gpu import decode_geometry as DG
from pallas_kernels.mosaic_gpu import tuning as MT
from pallas_kernels.mosaic_gpu.decode import decode_reason, paged_decode_attention
from pallas_kernels.mosaic_gpu.adapters import ADAPTERS
from pallas_kernels.mosaic_gpu.compat import JAX_VERSION
from pallas_kernels.mosaic_gpu.formats import Fp8Operands, PlainOperands
from pallas_kernels.mosaic_gpu.group_formats import Nvfp4Operands
from pallas_kernels.mosaic_gpu.row_formats import RowScaledOperands

BF16 = jnp.bfloat16


# -- geometry ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8, 11])
def test_group_fits_the_query_columns_exactly_when_every_head_does(num_kv_heads):
  for group in range(1, 33):
    why = DG.group_reason(group, num_kv_heads)
    geo = DG.DecodeGeometry(group, 16, 128)
    need = max(geo.col_offset(h) + group for h in range(num_kv_heads))
    assert (why is None) == (need <= geo.cols), (group, why)
    for h in range(num_kv_heads):        # head h's rows start on an 8-row tile
      assert (h * group - geo.col_offset(h)) % DG.ALIGN_ROWS == 0
  for group in (1, 2, 4, 7, 8, 9, 16):   # every group up to 9, and the aligned ones up to 16
    assert DG.group_reason(group, 8) is None
  assert "GQA group 11" in DG.group_reason(11, 8)


@pytest.mark.parametrize("finish", [False, True])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8", "int8_per_token_head", "nvfp4"])
@pytest.mark.parametrize("head_size", [64, 128, 192, 256])
def test_geometry_fits_the_most_blocks_then_slots(cache_dtype, head_size, finish):
  layout = "HND" if cache_dtype == "nvfp4" else "NHD"      # nvfp4 has no NHD
  spec = kvjax.KVCacheSpec(8, head_size, 16, cache_dtype, layout=layout, dtype=BF16)
  ops = ADAPTERS.hooks(spec.codec).of(spec, BF16)
  per_sm = MT.decode_blocks_per_sm(cache_dtype)
  geo = DG.choose_geometry(ops, 4, 16, head_size, finish=finish, blocks_per_sm=per_sm)
  fits = lambda g, blocks: blocks * g.smem_bytes(ops, finish) <= DG.SMEM_BUDGET
  two = dataclasses.replace(geo, stages=2)
  blocks = max(b for b in range(1, per_sm + 1) if fits(two, b))
  assert geo.stages >= 2 and fits(geo, blocks)
  bigger = dataclasses.replace(geo, stages=geo.stages + 1)
  assert geo.stages == 8 or not fits(bigger, blocks)


def test_geometry_rejects_what_the_kernel_cannot_tile():
  with pytest.raises(ValueError, match="head_size=96"):
    DG.DecodeGeometry(4, 16, 96)
  with pytest.raises(ValueError, match="block_kv=128"):
    DG.DecodeGeometry(4, 16, 128, block_kv=128)
  with pytest.raises(ValueError, match="stages=1"):
    DG.DecodeGeometry(4, 16, 128, stages=1)
  with pytest.raises(ValueError, match="round_steps=3"):
    DG.DecodeGeometry(4, 16, 128, round_steps=3)
  with pytest.raises(ValueError, match="block_size=20"):   # copies of gcd(20, 64) = 4 tokens
    DG.DecodeGeometry(4, 20, 128)
  assert DG.DecodeGeometry(4, 24, 128).piece == 8
  for n in (16, 32, 48, 64, 128, 256):
    geo = DG.DecodeGeometry(4, n, 128)
    assert n % geo.piece == 0 and geo.block_kv % geo.piece == 0 and geo.piece % 8 == 0


@pytest.mark.parametrize("per_sm", [2, 3])
def test_split_rule_fills_the_sms(per_sm):
  slots = per_sm * 132
  splits = lambda seqs, heads, steps: DG.num_splits_for(seqs, heads, steps, 132, per_sm)
  assert splits(slots // 4, 4, 64) == 1      # one full wave of blocks
  assert splits(slots // 4, 8, 16) == 1      # two full waves
  for seqs, heads in ((8, 8), (16, 8), (1, 8), (3, 2), (100, 1)):
    k = splits(seqs, heads, 512)
    base = seqs * heads
    fill = base * k / (-(-base * k // slots) * slots)   # busy share of the waves
    assert fill >= 0.75 and k <= 64, (seqs, heads, k, fill)
  assert splits(1, 1, 7) == 1                # at least 4 steps a split
  assert splits(1, 1, 12) == 3


def test_formats_take_their_blocks_per_sm():
  """nvfp4's statics are sized for its own blocks an SM, the others' for the default."""
  for cache_dtype in ("bfloat16", "nvfp4")[:2 if JAX_VERSION >= (0, 11) else 1]:
    spec = kvjax.KVCacheSpec(8, 128, 16, cache_dtype, layout="HND", dtype=BF16)
    per_sm = MT.decode_blocks_per_sm(cache_dtype)
    st = MD.decode_statics(spec, BF16, 24, 32, 24, 64, 256, num_sms=132)
    ops = ADAPTERS.hooks(spec.codec).of(spec, BF16)
    assert st.geo == DG.choose_geometry(ops, 4, 16, 128, finish=st.finish,
                                        blocks_per_sm=per_sm)
    assert st.num_splits == DG.num_splits_for(24, 8, 16, 132, per_sm)
  assert MT.decode_blocks_per_sm("nvfp4") != MT.decode_blocks_per_sm("bfloat16")


# -- which calls take it -----------------------------------------------------------------------
def test_decode_reason():
  assert decode_reason(kvjax.KVCacheSpec(8, 128, 16, dtype=BF16), BF16, 4) is None
  assert decode_reason(kvjax.KVCacheSpec(8, 128, 16, "fp8", dtype=BF16), BF16, 4) is None
  assert decode_reason(kvjax.KVCacheSpec(8, 128, 16, "fp8_e5m2", layout="HND"), BF16) is None
  assert decode_reason(kvjax.KVCacheSpec(8, 128, 16, "int8_per_token_head"), BF16) is None
  assert decode_reason(kvjax.KVCacheSpec(3, 64, 32, "fp8_per_token_head", layout="HND"),
                       jnp.float16) is None
  assert "256 data bytes + 16 <= 256" in decode_reason(
      kvjax.KVCacheSpec(8, 256, 16, "int8_per_token_head"), BF16)
  assert decode_reason(kvjax.KVCacheSpec(8, 128, 16, "int4_per_token_head"), BF16) is None
  nvfp4 = kvjax.KVCacheSpec(8, 128, 16, "nvfp4", layout="HND")
  if JAX_VERSION < (0, 11):
    assert "jax >= 0.11" in decode_reason(nvfp4, BF16)
  else:
    assert decode_reason(nvfp4, BF16) is None
    for d in (64, 192):
      assert f"head_size={d}" in decode_reason(kvjax.KVCacheSpec(2, d, 16, "nvfp4",
                                                                 layout="HND"), BF16)
  assert ADAPTERS.hooks(nvfp4.codec) is Nvfp4Operands
  assert "head_size=80" in decode_reason(kvjax.KVCacheSpec(8, 80, 16, dtype=BF16), BF16)
  assert "differs" in decode_reason(kvjax.KVCacheSpec(8, 128, 16, dtype=BF16), jnp.float16)
  assert "float32" in decode_reason(kvjax.KVCacheSpec(8, 128, 16, dtype=BF16), jnp.float32)
  assert "GQA group 11" in decode_reason(kvjax.KVCacheSpec(8, 128, 16, dtype=BF16), BF16, 11)
  assert ADAPTERS.hooks(kvjax.KVCacheSpec(2, 64, 16).codec) is PlainOperands
  assert ADAPTERS.hooks(kvjax.KVCacheSpec(2, 64, 16, "fp8").codec) is Fp8Operands
  for fmt in ("int8_per_token_head", "fp8_per_token_head"):
    assert ADAPTERS.hooks(kvjax.KVCacheSpec(2, 64, 16, fmt).codec) is RowScaledOperands


@pytest.mark.parametrize("layout,h,tokens_per_row", [("NHD", 2, 1), ("NHD", 1, 2),
                                                     ("NHD", 3, 2), ("HND", 4, 2)])
def test_row_scaled_view_keeps_tma_strides_16_byte_aligned(layout, h, tokens_per_row):
  """A per-token-head row is 8 bytes off 16 (``2 * (D + 4)``): the kernel's view holds two
  tokens a row where one token's rows are not 16 bytes apart; the view is a reshape."""
  from pallas_kernels.mosaic_gpu.decode import cache_view, decode_statics
  spec = kvjax.KVCacheSpec(h, 128, 16, "int8_per_token_head", layout=layout)
  st = decode_statics(spec, BF16, 4, 4 * h, 4, 8, 32)
  assert st.tokens_per_row == tokens_per_row
  cache = jnp.arange(np.prod(spec.physical_shape(32))).reshape(spec.physical_shape(32))
  view = cache_view(cache, st)
  assert (view.shape[-1] * spec.itemsize) % 16 == 0 and view.shape[-2] == 16 // tokens_per_row
  assert (np.asarray(view).reshape(-1) == np.asarray(cache).reshape(-1)).all()
  with pytest.raises(ValueError, match="layered"):
    decode_statics(spec, BF16, 4, 4 * h, 4, 8, 32, layered=True)


def test_round_steps_cover_each_key_once():
  """A round's steps read every key of its span once: T consecutive keys a step (one token a
  view row) or the tokens of one parity (two); two-token rows need two steps a round."""
  from pallas_kernels.mosaic_gpu.decode import decode_statics
  cases = [("bfloat16", "NHD", 2, 1), ("bfloat16", "NHD", 2, 2),
           ("int8_per_token_head", "HND", 2, 2), ("int4_per_token_head", "NHD", 2, 1)]
  for fmt, layout, h, u in cases:
    spec = kvjax.KVCacheSpec(h, 128, 16, fmt, layout=layout)
    geo = DG.DecodeGeometry(4, 16, 128, stages=2, round_steps=u)
    st = decode_statics(spec, BF16, 4, 4 * h, 4, 8, 32, geometry=geo)
    keys = sorted(st.key_offset(j) + st.tokens_per_row * t
                  for j in range(u) for t in range(geo.block_kv))
    assert keys == list(range(st.span)), (fmt, layout, u)
    assert st.step_span == geo.block_kv * st.tokens_per_row
    assert st.copies_per_step * st.piece == st.step_span
  two_tokens = kvjax.KVCacheSpec(2, 128, 16, "int8_per_token_head", layout="HND")
  with pytest.raises(ValueError, match="round_steps=1"):
    decode_statics(two_tokens, BF16, 4, 8, 4, 8, 32,
                   geometry=DG.DecodeGeometry(4, 16, 128, round_steps=1))
  assert decode_statics(two_tokens, BF16, 4, 8, 4, 8, 32).geo.round_steps == 2


def test_landing_offsets_follow_each_rows_byte_offset():
  """A TMA box starts on 16 bytes: a side row lands as far into its slot row as it sits
  past the boundary before it, which the kernel knows statically per head parity (NHD) and
  step parity (two tokens a view row): checked against the rows' byte offsets."""
  from pallas_kernels.mosaic_gpu.decode import cache_view, decode_statics
  for fmt, layout, h in [("int8_per_token_head", "NHD", 2), ("int8_per_token_head", "NHD", 3),
                         ("fp8_per_token_head", "HND", 2), ("int4_per_token_head", "NHD", 1),
                         ("int4_per_token_head", "HND", 4)]:
    spec = kvjax.KVCacheSpec(h, 128, 16, fmt, layout=layout)
    st = decode_statics(spec, BF16, 4, 4 * h, 4, 8, 32)
    offsets = np.arange(np.prod(spec.physical_shape(2))).reshape(spec.physical_shape(2))
    view = np.asarray(cache_view(jnp.asarray(offsets), st))
    for head in range(h):
      for tok in range(spec.block_size):
        parity = tok % st.tokens_per_row
        for side, want in zip((0, 1), st.landing_offsets(head % 2, parity)):
          col = parity * view.shape[-1] // st.tokens_per_row + side * st.side_dim
          row = tok // st.tokens_per_row
          if layout == "NHD":
            first = view[1, row, col + head * st.content_dim]
          else:
            first = view[1, head, row, col]
          assert first == offsets[(1, tok, head) if layout == "NHD" else (1, head, tok)][
              side * spec.padded_head_size], (fmt, layout, head, tok, side)
          assert first % 16 == want, (fmt, layout, head, tok, side)
    assert st.head_parities == ((0, 1) if layout == "NHD" and st.content_dim % 16 else (0,))


def test_auto_rule_for_decode_batches():
  def call(tokens, seqs, mql, hq=32):
    return registry.AttentionCall(num_tokens=tokens, num_q_heads=hq, num_seqs=seqs,
                                  max_blocks=256, max_query_len=mql)
  plain = kvjax.KVCacheSpec(8, 128, 16, dtype=BF16)
  for fmt, layout in (("auto", "NHD"), ("fp8_per_token_head", "NHD"),
                      ("fp8_per_token_head", "HND"), ("int8_per_token_head", "NHD"),
                      ("int4_per_token_head", "NHD")):
    spec = kvjax.KVCacheSpec(8, 128, 16, fmt, layout=layout, dtype=BF16)
    why = MA.prefer_attention(spec, BF16, call(64, 64, 1))
    assert (why is None) == ((spec.cache_dtype, layout) in MT.auto_decode()), (fmt, layout,
                                                                                 why)
    if why is not None:
      assert f"faster on {spec.cache_dtype} {layout}" in why
  assert {("fp8_per_token_head", "NHD"), ("int8_per_token_head", "NHD")} <= MT.AUTO_DECODE
  # per GPU: the H200's own measurements; other GPUs the default
  h200 = MT.auto_decode("NVIDIA H200")
  assert ("fp8_per_token_head", "NHD") in h200 and ("int8_per_token_head", "NHD") not in h200
  assert MT.auto_decode("NVIDIA H100 80GB HBM3") == MT.AUTO_DECODE
  assert MT.auto_decode("") == MT.AUTO_DECODE
  nvfp4 = kvjax.KVCacheSpec(8, 128, 16, "nvfp4", layout="HND")
  assert ("faster on nvfp4 HND" if JAX_VERSION >= (0, 11) else "jax >= 0.11") in \
      MA.prefer_attention(nvfp4, BF16, call(64, 64, 1))
  # not a decode batch: the ragged kernel's rule
  assert "Triton kernels are faster" in MA.prefer_attention(plain, BF16, call(64, 16, 4))
  assert MA.prefer_attention(plain, BF16, call(16384, 4, 4096)) is None
  assert MA._decode_kernel_reason(plain, BF16, 64, 64, 32, 1) is None
  assert "not a decode batch" in MA._decode_kernel_reason(plain, BF16, 65, 64, 32, 1)
  assert "not a decode batch" in MA._decode_kernel_reason(plain, BF16, 64, 64, 32, None)
  # every per-token-head row format decodes with the decode kernel's direct reads
  for fmt in ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"):
    spec = kvjax.KVCacheSpec(8, 128, 16, fmt)
    assert MA._decode_kernel_reason(spec, BF16, 64, 64, 32, 1) is None


def test_auto_rule_takes_every_supported_call_once_the_triton_lowering_is_gone(monkeypatch):
  call = registry.AttentionCall(num_tokens=64, num_q_heads=32, num_seqs=64, max_blocks=256,
                                max_query_len=1)
  spec = kvjax.KVCacheSpec(8, 128, 16, "int4_per_token_head", layout="NHD", dtype=BF16)
  assert "faster on int4_per_token_head" in MA.prefer_attention(spec, BF16, call)
  monkeypatch.setattr(MA, "triton_lowering_available", lambda: False)
  assert MA.prefer_attention(spec, BF16, call) is None
  short = dataclasses.replace(call, num_tokens=256, num_seqs=16, max_query_len=16)
  assert MA.prefer_attention(spec, BF16, short) is None


# -- lowering for CUDA -------------------------------------------------------------------------
#: nvfp4's hooks concatenate registers and store through reshaped views: jax >= 0.11.
NEEDS_JAX_011 = pytest.mark.skipif(JAX_VERSION < (0, 11), reason="nvfp4 hooks: jax >= 0.11")

LOWER_CASES = [
    # cache_dtype, layout, H, G, D, N, kwargs
    ("bfloat16", "NHD", 2, 4, 128, 16, {}),
    ("fp8", "HND", 2, 7, 64, 32, dict(sliding_window=64, soft_cap=30.0, sinks=True)),
    pytest.param("float16", "HND", 3, 16, 256, 128, dict(num_splits=3), marks=pytest.mark.slow),
    pytest.param("fp8_e5m2", "NHD", 1, 1, 192, 48, {}, marks=pytest.mark.slow),
    ("bfloat16", "HND", 2, 5, 128, 16, dict(finish=True, sinks=True, soft_cap=20.0)),
    pytest.param("fp8", "NHD", 4, 2, 256, 32, dict(finish=True), marks=pytest.mark.slow),
    # row-scaled: one token a view row (NHD, H even), two (HND)
    ("int8_per_token_head", "NHD", 2, 4, 128, 16, dict(finish=True, sinks=True)),
    ("fp8_per_token_head", "HND", 3, 5, 64, 32, dict(num_splits=2, soft_cap=20.0)),
    pytest.param("int8_per_token_head", "NHD", 1, 8, 192, 64, dict(sliding_window=64),
                 marks=pytest.mark.slow),
    ("int4_per_token_head", "HND", 2, 4, 128, 16, dict(finish=True, sinks=True)),
    pytest.param("int4_per_token_head", "NHD", 3, 2, 64, 32, dict(num_splits=2),
                 marks=pytest.mark.slow),
    pytest.param("int4_per_token_head", "NHD", 1, 4, 256, 16, dict(finish=True),
                 marks=pytest.mark.slow),
    pytest.param("nvfp4", "HND", 2, 4, 128, 16, dict(num_splits=2), marks=NEEDS_JAX_011),
    pytest.param("nvfp4", "HND", 1, 8, 256, 64, dict(finish=True, sinks=True),
                 marks=NEEDS_JAX_011),
]


@pytest.mark.parametrize("cache_dtype,layout,h,group,head_size,block_size,kw", LOWER_CASES)
def test_lowers_to_mosaic_gpu_for_cuda(cache_dtype, layout, h, group, head_size, block_size, kw):
  dtype = jnp.float16 if cache_dtype == "float16" else BF16
  spec = kvjax.KVCacheSpec(h, head_size, block_size, cache_dtype, layout=layout, dtype=dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  q = jax.ShapeDtypeStruct((5, h * group, head_size), dtype)
  cache = jax.ShapeDtypeStruct(spec.physical_shape(32), spec.storage_dtype)
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.zeros(h * group, jnp.float32)

  def f(q, c, sl, bt, scale, ks):
    return paged_decode_attention(q, c, spec, seq_lens=sl, block_table=bt, scale=scale,
                                  k_scale=ks, v_scale=ks, **kw)
  f32 = jax.ShapeDtypeStruct((), jnp.float32)
  text = export.export(jax.jit(f), platforms=["cuda"])(q, cache, i32(5), i32(5, 8), f32,
                                                         f32).mlir_module()
  assert "mosaic_gpu" in text


# -- numerics: interpret mode, or compiled with KVJAX_TEST_COMPILED=1 --------------------------

NUMERICS_CASES = [
    # cache_dtype, layout, H, G, D, N, seq_lens, kwargs
    ("bfloat16", "NHD", 2, 4, 64, 16, [1, 70, 0, 130], dict(num_splits=2)),
    ("fp8", "HND", 2, 7, 64, 32, [200, 5], dict(sliding_window=40, soft_cap=5.0, sinks=True,
                                                 num_splits=3)),
    ("bfloat16", "HND", 1, 16, 64, 48, [65, 129], {}),
    # finish mode: one split, the kernel writes the output rows (sinks in the kernel)
    ("bfloat16", "NHD", 3, 5, 128, 16, [1, 70, 0, 130], dict(num_splits=1, finish=True,
                                                             sinks=True)),
    ("fp8", "HND", 2, 7, 64, 32, [200, 5, 0], dict(sliding_window=40, soft_cap=5.0,
                                                    sinks=True, finish=True)),
    ("float16", "NHD", 2, 1, 64, 64, [300, 2], dict(sinks=True, finish=True)),
    # query rows by query_start_loc: sequence 1 has no query row, row 3 no sequence
    ("bfloat16", "NHD", 2, 4, 64, 16, [70, 5, 130], dict(query_counts=[1, 0, 1], rows=4)),
    ("bfloat16", "HND", 2, 4, 64, 16, [70, 5, 130], dict(query_counts=[0, 1, 1], rows=3,
                                                         finish=True, num_splits=1)),
    # row-scaled (per token-head) rows, one or two tokens a view row (stale NaN scales read)
    ("int8_per_token_head", "NHD", 2, 4, 64, 16, [1, 70, 0, 130], dict(num_splits=2)),
    ("int8_per_token_head", "NHD", 1, 8, 128, 32, [200, 5], dict(sliding_window=40,
                                                               soft_cap=5.0, sinks=True,
                                                               finish=True)),
    ("fp8_per_token_head", "HND", 2, 7, 64, 16, [65, 129, 0], dict(sinks=True, finish=True)),
    ("fp8_per_token_head", "NHD", 3, 1, 64, 48, [97, 3], dict(num_splits=3)),
    # rounds of two steps (one softmax update): one token a view row, register K (fp8)
    ("fp8", "NHD", 2, 4, 64, 16, [1, 70, 0, 130], dict(num_splits=2, round_steps=2,
                                                       sliding_window=40)),
    # int4 codes: zero points out of the products, dims in the kernel's order and back
    ("int4_per_token_head", "NHD", 3, 4, 128, 16, [1, 70, 0, 130], dict(num_splits=2,
                                                                       soft_cap=5.0)),
    ("int4_per_token_head", "HND", 1, 7, 64, 32, [200, 5], dict(sliding_window=40, sinks=True,
                                                              finish=True)),
    # nvfp4: group scales staged per step (K per token, V 4x4-swizzled), dims [even | odd]
    ("nvfp4", "HND", 2, 4, 128, 16, [1, 70, 0, 130], dict(num_splits=2, soft_cap=5.0)),
    ("nvfp4", "HND", 1, 7, 128, 32, [200, 5], dict(sliding_window=40, sinks=True,
                                                  finish=True)),
]


@mosaic_gpu_numerics
@pytest.mark.parametrize("layout,finish", [("NHD", True), ("HND", False)])
def test_layered_cache_reads_its_layer(rng, layout, finish):
  """A layered (5-D) cache, the layer a traced operand: equal to the reference reading that
  layer (the other layers hold NaN)."""
  spec = kvjax.KVCacheSpec(2, 64, 16, "bfloat16", layout=layout, dtype=BF16)
  blocks, layers, layer = 8, 3, 2
  lens = [40, 100]
  bt = np.arange(16, dtype=np.int32).reshape(2, 8) % blocks
  bt[1] = [4, 5, 6, 7, 0, 1, 2, 3]
  cache = jnp.full(spec.physical_shape(blocks, layers), jnp.nan, BF16)
  slots = np.arange(blocks * 16, dtype=np.int32)
  k, v = (jnp.asarray(rng.standard_normal((len(slots), 2, 64)), BF16) for _ in range(2))
  cache = kvjax.write_kv(cache, k, v, jnp.asarray(slots), spec, impl="reference", layer=layer)
  q = jnp.asarray(rng.standard_normal((2, 8, 64)), BF16)
  meta = dict(seq_lens=jnp.asarray(lens, jnp.int32), block_table=jnp.asarray(bt))
  out = jax.jit(lambda q, c, li: paged_decode_attention(
      q, c, spec, scale=0.125, interpret=not COMPILED, layer=li, finish=finish,
      num_splits=1 if finish else 2, **meta))(q, cache, jnp.int32(layer))
  want = kvjax.unified_attention(q, cache, spec, scale=0.125, impl="reference", layer=layer,
                                 query_start_loc=jnp.arange(3, dtype=jnp.int32), **meta)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


@mosaic_gpu_numerics
@pytest.mark.parametrize("cache_dtype,layout,h,group,head_size,block_size,lens,kw",
                         NUMERICS_CASES)
def test_kernel_matches_reference(rng, cache_dtype, layout, h, group, head_size, block_size,
                                  lens, kw):
  dtype = jnp.float16 if cache_dtype == "float16" else BF16
  spec = kvjax.KVCacheSpec(h, head_size, block_size, cache_dtype, layout=layout, dtype=dtype)
  n = block_size
  pages = [max(1, -(-ln // n)) for ln in lens]
  width = max(pages) + 1
  num_blocks = sum(pages) + 3
  perm = rng.permutation(num_blocks)
  bt = np.full((len(lens), width), perm[-1], np.int32)        # unused entries: a NaN page
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    used += p
  shape = spec.physical_shape(num_blocks)
  if spec.itemsize == 1:      # 0xFF bytes: NaN fp8 values and NaN float32 row scales
    cache = jax.lax.bitcast_convert_type(jnp.full(shape, 0xFF, jnp.uint8), spec.storage_dtype)
  else:
    cache = jnp.full(shape, jnp.nan, spec.storage_dtype)
  slots = np.concatenate([bt[s, np.arange(ln) // n] * n + np.arange(ln) % n
                          for s, ln in enumerate(lens)]).astype(np.int32)
  k, v = (jnp.asarray(rng.standard_normal((len(slots), h, head_size)), dtype) for _ in range(2))
  scales = 0.5 if spec.codec.has_tensor_scales else None
  cache = write_kv(cache, k, v, jnp.asarray(slots), spec, k_scale=scales, v_scale=scales)
  counts = kw.pop("query_counts", [1] * len(lens))
  qsl = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
  q = jnp.asarray(rng.standard_normal((kw.pop("rows", len(lens)), h * group, head_size)),
                  dtype)
  kw = dict(kw, scale=head_size ** -0.5, k_scale=scales, v_scale=scales)
  geometry = None
  if "round_steps" in kw:
    geometry = DG.DecodeGeometry(group, block_size, head_size, stages=3,
                                 round_steps=kw.pop("round_steps"))
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(h * group), jnp.float32)
  meta = dict(seq_lens=jnp.asarray(lens, jnp.int32), block_table=jnp.asarray(bt))
  out = np.asarray(paged_decode_attention(q, cache, spec, interpret=not COMPILED,
                                          query_start_loc=qsl, geometry=geometry, **meta,
                                          **kw),
                   np.float32)
  kw.pop("num_splits", None)
  kw.pop("finish", None)
  want = np.asarray(jax.jit(functools.partial(ref_attention, spec=spec, **kw))(
      q, cache, query_start_loc=qsl, **meta), np.float32)
  assert np.isfinite(out).all()
  seq_of_row = np.searchsorted(np.asarray(qsl), np.arange(q.shape[0]), side="right") - 1
  no_keys = (seq_of_row >= len(lens)) | (np.asarray(lens + [0])[seq_of_row] == 0)
  assert no_keys.any() == (0 in lens or q.shape[0] > qsl[-1])
  assert not out[no_keys].any(), "a row with no keys outputs 0"
  np.testing.assert_allclose(out, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)
