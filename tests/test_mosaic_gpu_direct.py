"""The Mosaic GPU ragged kernel reading a quantized cache as stored (``read="direct"``,
pallas_kernels.mosaic_gpu.ragged_landing): which formats it takes, its shared memory, its
lowering for CUDA on any machine, and its numerics (Mosaic GPU interpret mode with jax >= 0.11,
or compiled with ``KVJAX_TEST_COMPILED=1``) against the plain-copy read and the reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvjax
from kv_testing import poisoned_ragged_batch, spec_for
from op_suite import COMPILED, mosaic_gpu_numerics
from pallas_kernels.mosaic_gpu import ragged_attention as R
from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu import tuning as MT

BF16 = jnp.bfloat16


def test_direct_reason_names_the_formats_read_through_a_copy():
  assert R.direct_reason(spec_for("fp8", head_size=128, dtype=BF16), BF16) is None
  assert R.direct_reason(spec_for("fp8_e5m2", "HND", head_size=64, dtype=BF16), BF16) is None
  assert "plain copy" in R.direct_reason(spec_for("int8_per_token_head", head_size=128), BF16)
  assert "plain copy" in R.direct_reason(spec_for("nvfp4", "HND", head_size=128), BF16)
  assert "is plain" in R.direct_reason(spec_for("bfloat16", head_size=128, dtype=BF16), BF16)
  assert "float32" in R.direct_reason(spec_for("fp8", head_size=128), jnp.float32)


def test_read_is_checked():
  spec = spec_for("int4_per_token_head", head_size=64, num_kv_heads=1, dtype=BF16)
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
  kw = dict(query_start_loc=i32(2), seq_lens=i32(1), block_table=i32(1, 2), scale=0.1)
  q = jnp.ones((4, 2, 64), BF16)
  with pytest.raises(ValueError, match="read must be one of"):
    R.ragged_paged_attention(q, spec.allocate(2), spec, read="stored", **kw)
  with pytest.raises(ValueError, match="read='direct'.*plain copy"):
    R.ragged_paged_attention(q, spec.allocate(2), spec, read="direct", **kw)


def test_landing_slots_count_in_shared_memory():
  """Both sides' landed bytes (block_kv rows of D bytes each) next to the plain slots: the
  geometry gives up q's own staging buffer or a slot for them, and still fits."""
  spec = spec_for("fp8", head_size=128, num_kv_heads=8, dtype=BF16)
  ops = R._direct_operands(spec, BF16, "direct")
  st = R.ragged_statics(spec, BF16, 16384, 32, 4, 256, 4096, max_query_len=4096, ops=ops)
  plain = R.ragged_statics(spec, BF16, 16384, 32, 4, 256, 4096, max_query_len=4096)
  assert st.landing == 128 and plain.landing == 0
  need = st.geo.smem_bytes(128, 2, st.pv, st.staging, landing=st.landing)
  assert need <= TL.SMEM_BUDGET
  assert need - st.geo.smem_bytes(128, 2, st.pv, st.staging) == 2 * st.geo.block_kv * 128
  assert st.staging != plain.staging or st.geo.stages < plain.geo.stages


def test_default_read_follows_the_tuning_table(monkeypatch):
  spec = spec_for("fp8", head_size=128, dtype=BF16)
  monkeypatch.setattr(MT, "RAGGED_DIRECT", frozenset())
  assert R._direct_operands(spec, BF16, None) is None
  monkeypatch.setattr(MT, "RAGGED_DIRECT", frozenset({"fp8"}))
  assert R._direct_operands(spec, BF16, None) is not None
  assert R._direct_operands(spec, BF16, "copy") is None


@pytest.mark.parametrize("cache_dtype,layout,head_size", [("fp8", "NHD", 128),
                                                          ("fp8_e5m2", "HND", 64)])
def test_lowers_for_cuda_reading_as_stored(cache_dtype, layout, head_size):
  """As the GPU runs it (P in registers, persistent blocks): landing copies, the producer's
  conversion into the plain slots and its arrivals lower."""
  spec = spec_for(cache_dtype, layout, head_size=head_size, num_kv_heads=2, dtype=BF16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)

  def f(q, c, qsl, sl, bt):
    return R.ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                          block_table=bt, scale=0.1, max_query_len=64,
                                          num_programs=3, read="direct", k_scale=0.5,
                                          v_scale=2.0)
  text = export.export(jax.jit(f), platforms=["cuda"])(
      jax.ShapeDtypeStruct((77, 8, head_size), BF16),
      jax.ShapeDtypeStruct(spec.physical_shape(32), spec.storage_dtype), i32(5), i32(4),
      i32(4, 8)).mlir_module()
  assert "mosaic_gpu" in text


@mosaic_gpu_numerics
@pytest.mark.parametrize("cache_dtype,layout,head_size,group,kw", [
    # two plain slots and one block walking every item: slots and landing barriers carry
    # over from item to item
    ("fp8", "NHD", 64, 4, dict(stages=2, programs=1)),
    ("fp8_e5m2", "HND", 64, 7, dict(sliding_window=30, soft_cap=5.0, sinks=True)),
    ("fp8", "HND", 128, 2, dict(causal=False, programs=2)),
])
def test_direct_read_matches_the_copy_and_the_reference(rng, cache_dtype, layout, head_size,
                                                        group, kw):
  """On caches of 0xFF bytes (NaN) wherever no token was written, with tensor scales."""
  spec = spec_for(cache_dtype, layout, head_size=head_size, num_kv_heads=2, dtype=BF16)
  k_scale, v_scale = 0.75, 1.5
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, 2 * group, k_scale=k_scale,
                                                v_scale=v_scale)
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(2 * group) * 2, jnp.float32)
  geo = TL.choose_geometry(group, head_size, spec.block_size, 32,
                           landing=head_size * spec.itemsize)
  if "stages" in kw:
    geo = dataclasses.replace(geo, stages=kw.pop("stages"))
  programs = kw.pop("programs", 0)
  args = dict(query_start_loc=qsl, seq_lens=sl, block_table=bt, max_query_len=32,
              k_scale=k_scale, v_scale=v_scale, **kw)
  run = lambda read: np.asarray(R.ragged_paged_attention_tiled(
      q, cache, spec, scale=head_size ** -0.5, interpret=not COMPILED, geometry=geo,
      num_programs=programs, read=read, **args), np.float32)
  direct, copy = run("direct"), run("copy")
  ref = np.asarray(kvjax.unified_attention(q, cache, spec, scale=head_size ** -0.5,
                                           impl="reference", **args), np.float32)
  real = int(qsl[-1])
  assert np.all(direct[real:] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(direct).all()
  # the same plain values reach the same products: equal to the copy's output
  np.testing.assert_array_equal(direct, copy)
  np.testing.assert_allclose(direct, ref, atol=2e-2 * np.abs(ref).max(), rtol=2e-2)
