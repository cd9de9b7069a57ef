"""The Mosaic GPU ragged kernel rotating q and un-rotating its output itself (int4 per token-head,
whose rows are stored Hadamard-rotated): shared-memory accounting on any machine, numerics in
Mosaic GPU interpret mode (jax >= 0.11) or compiled with ``KVJAX_TEST_COMPILED=1``."""
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


@pytest.mark.parametrize("head_size,fits", [(64, True), (128, True), (256, False)])
def test_rotation_matrix_fits_next_to_the_tile_up_to_head_size_128(head_size, fits):
  spec = spec_for("int4_per_token_head", head_size=head_size, num_kv_heads=8)
  group = TL.max_group(head_size)
  assert R._rotation_fits(spec, jnp.bfloat16, 8 * group, 16384, 4096, None, False,
                          None) is fits
  if fits:
    geo = TL.choose_geometry(group, head_size, 16, 4096, rotation=True)
    staging = TL.choose_staging(geo, head_size, rotation=True)
    assert geo.smem_bytes(head_size, 2, staging=staging, rotation=True) <= TL.SMEM_BUDGET
    assert (geo.smem_bytes(head_size, 2, staging=staging, rotation=True)
            - geo.smem_bytes(head_size, 2, staging=staging)) == head_size ** 2 * 2


def test_products_are_the_rotations_ops():
  rot = kvjax.get_format("int4_per_token_head").codec.rotation
  rt, factor = rot.products(64)
  x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(rot.rotate(x)), x @ rt.T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(rot.unrotate(x)), x @ rt * factor, rtol=1e-5,
                             atol=1e-5)
  assert kvjax.get_format("bfloat16").codec.rotation.products(64) is None


@mosaic_gpu_numerics
@pytest.mark.parametrize("cache_dtype,layout,head_size,group,inside", [
    ("int4_per_token_head", "NHD", 64, 4, True),
    ("int4_per_token_head", "HND", 128, 2, True),
    ("int4_per_token_head", "NHD", 128, 7, COMPILED),  # interpret: P's buffer takes the room
    ("int4_per_token_head", "HND", 256, 2, False),     # the rotation's ops around the kernel
    ("bfloat16", "NHD", 64, 2, False),                 # no rotation: nothing changes
])
def test_kernel_in_the_models_frame_matches_the_public_reference(rng, cache_dtype, layout,
                                                                  head_size, group, inside):
  spec = spec_for(cache_dtype, layout, head_size=head_size, num_kv_heads=1,
                  dtype=jnp.bfloat16)
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, group)
  if spec.codec.rotation.products(head_size) is not None:
    assert R._rotation_fits(spec, q.dtype, group, q.shape[0], 32, None, not COMPILED,
                            None) is inside
  scale = head_size ** -0.5
  kw = dict(query_start_loc=qsl, seq_lens=sl, block_table=bt, max_query_len=32,
            sliding_window=30, sinks=jnp.asarray(rng.standard_normal(group), jnp.float32))
  out = R.ragged_paged_attention(
      q, cache, spec, scale=spec.codec.rotation.softmax_scale(scale, head_size),
      interpret=not COMPILED, model_frame=True, **kw)
  ref = kvjax.unified_attention(q, cache, spec, scale=scale, impl="reference", **kw)
  o, r = (np.asarray(x, np.float32) for x in (out, ref))
  real = int(qsl[-1])
  assert np.all(o[real:] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(o).all()
  np.testing.assert_allclose(o, r, atol=2e-2 * np.abs(r).max(), rtol=2e-2)


@pytest.mark.parametrize("layout,group,head_size", [("NHD", 4, 128), ("HND", 8, 64)])
def test_lowers_for_cuda_with_the_rotation_inside(layout, group, head_size):
  """As the GPU runs it (P in registers, persistent blocks): the matrix's copy into tiled
  shared memory and both of its products lower, next to two K/V slots at head size 128."""
  spec = spec_for("int4_per_token_head", layout, head_size=head_size, num_kv_heads=2,
                  dtype=jnp.bfloat16)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  assert R._rotation_fits(spec, jnp.bfloat16, 2 * group, 77, 64, None, False, None)

  def f(q, c, qsl, sl, bt):
    return R.ragged_paged_attention_tiled(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                          block_table=bt, scale=0.1, max_query_len=64,
                                          num_programs=3, model_frame=True)
  text = export.export(jax.jit(f), platforms=["cuda"])(
      jax.ShapeDtypeStruct((77, 2 * group, head_size), jnp.bfloat16),
      jax.ShapeDtypeStruct(spec.physical_shape(32), spec.storage_dtype), i32(5), i32(4),
      i32(4, 8)).mlir_module()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("num_tokens,num_seqs", [(0, 2), (5, 0)])
def test_an_empty_batch_in_the_models_frame_gives_zeros(num_tokens, num_seqs):
  """No token or no sequence: zeros, before any tile is chosen (max_query_len None = T = 0)."""
  spec = spec_for("int4_per_token_head", head_size=128, num_kv_heads=2, dtype=jnp.bfloat16)
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
  out = R.ragged_paged_attention(
      jnp.ones((num_tokens, 8, 128), jnp.bfloat16), spec.allocate(4), spec,
      query_start_loc=i32(num_seqs + 1), seq_lens=i32(num_seqs), block_table=i32(num_seqs, 2),
      scale=0.1, model_frame=True)
  assert out.shape == (num_tokens, 8, 128) and not np.asarray(out, np.float32).any()
