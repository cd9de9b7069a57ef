"""Shapes, stride orders, view geometry and validation: docs/layout.md's worked numbers (§1-§3)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, get_kv_cache_shape, get_kv_cache_stride_order


@pytest.mark.parametrize("cache_dtype,shape", [
    ("auto", (10, 8, 16, 256)),
    ("bfloat16", (10, 8, 16, 256)),
    ("float32", (10, 8, 16, 256)),
    ("fp8", (10, 8, 16, 256)),
    ("fp8_e5m2", (10, 8, 16, 256)),
    ("int8_per_token_head", (10, 8, 16, 264)),
    ("fp8_per_token_head", (10, 8, 16, 264)),
    ("int4_per_token_head", (10, 8, 16, 136)),
    ("nvfp4", (10, 16, 16, 72)),
])
def test_kv_cache_shape_table(cache_dtype, shape):
  assert get_kv_cache_shape(10, 16, 8, 128, cache_dtype) == shape


def test_stride_orders():
  assert get_kv_cache_stride_order() == (0, 2, 1, 3)
  assert get_kv_cache_stride_order("NHD") == (0, 2, 1, 3)
  assert get_kv_cache_stride_order("HND") == (0, 1, 2, 3)
  assert get_kv_cache_stride_order("NHD", include_num_layers_dimension=True) == (1, 0, 3, 2, 4)
  assert get_kv_cache_stride_order("HND", include_num_layers_dimension=True) == (1, 2, 0, 3, 4)
  with pytest.raises(ValueError, match="layout"):
    get_kv_cache_stride_order("NDH")


def test_mla_shape():
  assert kvjax.get_mla_kv_cache_shape(7, 16, 576) == (7, 16, 576)
  mla = kvjax.MLACacheSpec(576, 16)
  assert mla.allocate(3).shape == (3, 16, 576)
  assert mla.page_bytes == 16 * 576 * 2


def test_bf16_view_numbers():
  """§3: bf16, B=10, H=8, N=16, D=128; page 65,536 bytes."""
  nhd = KVCacheSpec(8, 128, 16)
  assert nhd.page_bytes == 65536
  assert nhd.logical_strides(10) == (32768, 256, 2048, 1)
  k, v = nhd.kv_view_geometry(10)
  assert (k.shape, k.strides, k.offset) == ((10, 16, 8, 128), (32768, 2048, 256, 1), 0)
  assert (v.strides, v.offset) == ((32768, 2048, 256, 1), 128)
  hnd = KVCacheSpec(8, 128, 16, layout="HND")
  assert hnd.logical_strides(10) == (32768, 4096, 256, 1)
  assert hnd.kv_view_geometry(10)[0].strides == (32768, 256, 4096, 1)
  assert nhd.physical_shape(10) == (10, 16, 8, 256)
  assert hnd.physical_shape(10) == (10, 8, 16, 256)


def test_int8_scale_view_numbers():
  """§3: int8 NHD, B=3, H=2, N=16, D=128."""
  s = KVCacheSpec(2, 128, 16, cache_dtype="int8_per_token_head")
  assert s.logical_strides(3) == (8448, 264, 528, 1)
  k, v = s.kv_view_geometry(3)
  assert (k.shape, k.strides) == ((3, 16, 2, 132), (8448, 528, 264, 1))
  assert v.offset == 132
  ks, vs = s.scale_view_geometry(3)
  assert (ks.shape, ks.strides, ks.offset) == ((3, 16, 2), (2112, 132, 66), 32)
  assert vs.offset == 65


def test_nvfp4_split_numbers():
  """§5: D=128, H=8, N=16, HND: logical (5, 16, 16, 72)."""
  s = KVCacheSpec(8, 128, 16, cache_dtype="nvfp4", layout="HND")
  assert s.logical_shape(5) == (5, 16, 16, 72)
  assert s.logical_strides(5) == (18432, 1152, 72, 1)
  data, scale = s.nvfp4_split_geometry(5, "k")
  assert (data.shape, data.strides, data.offset) == ((5, 8, 16, 64), (18432, 1024, 64, 1), 0)
  assert (scale.shape, scale.strides, scale.offset) == ((5, 8, 16, 8), (18432, 128, 8, 1), 8192)
  vdata, vscale = s.nvfp4_split_geometry(5, "v")
  assert vdata.offset == 9216 and vscale.offset == 9216 + 8192


def test_cross_layer_physical_shapes():
  nhd = KVCacheSpec(8, 128, 16)
  assert nhd.logical_shape(10, num_layers=4) == (4, 10, 8, 16, 256)
  assert nhd.physical_shape(10, num_layers=4) == (10, 4, 16, 8, 256)
  hnd = KVCacheSpec(8, 128, 16, layout="HND")
  assert hnd.physical_shape(10, num_layers=4) == (10, 8, 4, 16, 256)
  assert nhd.allocate(2, num_layers=3).shape == (2, 3, 16, 8, 256)


def test_geometry_matches_numpy_strides():
  """The view geometry equals numpy's strides of the same views over a real array."""
  for layout in ("NHD", "HND"):
    s = KVCacheSpec(3, 64, 32, cache_dtype="int8_per_token_head", layout=layout)
    phys = np.zeros(s.physical_shape(4), np.int8)
    logical = phys.transpose(np.argsort(s.stride_order()))
    assert tuple(x // phys.itemsize for x in logical.strides) == s.logical_strides(4)
    kv = logical.transpose(0, 2, 1, 3)
    k_geo, _ = s.kv_view_geometry(4)
    assert tuple(x // phys.itemsize for x in kv.strides) == k_geo.strides


def test_spec_is_static_and_hashable():
  a = KVCacheSpec(4, 64, 16, dtype=jnp.float16)
  b = KVCacheSpec(4, 64, 16, dtype=np.float16)
  assert a == b and hash(a) == hash(b)
  f = jax.jit(lambda x, spec: x * spec.head_size, static_argnums=1)
  assert float(f(jnp.float32(2), a)) == 128.0


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(layout="NDH"), ValueError, "layout"),
    (dict(cache_dtype="fp16"), ValueError, "cache_dtype"),
    (dict(block_size=24), ValueError, "block_size"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(head_size=66, cache_dtype="int4_per_token_head"), ValueError, "head_size"),
    (dict(head_size=63, cache_dtype="int8_per_token_head"), ValueError, "head_size"),
    (dict(head_size=72, cache_dtype="nvfp4", layout="HND"), ValueError, "head_size"),
    (dict(cache_dtype="nvfp4", layout="NHD"), ValueError, "HND"),
    (dict(dtype=jnp.int8), TypeError, "dtype"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
])
def test_spec_rejects_bad_geometry(kwargs, err, match):
  base = dict(num_kv_heads=4, head_size=64, block_size=16)
  base.update(kwargs)
  with pytest.raises(err, match=match):
    KVCacheSpec(**base)


def test_get_kv_cache_shape_rejects():
  with pytest.raises(ValueError, match="block_size"):
    get_kv_cache_shape(4, 8, 2, 64)
  with pytest.raises(ValueError, match="cache_dtype"):
    get_kv_cache_shape(4, 16, 2, 64, "int3")


def test_cache_validation(rng):
  s = KVCacheSpec(2, 64, 16)
  good = s.allocate(3)
  assert s.num_blocks_of(good) == 3
  with pytest.raises(ValueError, match="physical shape"):
    s.num_blocks_of(jnp.zeros((3, 2, 16, 128), jnp.bfloat16))   # HND shape for an NHD spec
  with pytest.raises(TypeError, match="dtype"):
    s.num_blocks_of(jnp.zeros((3, 16, 2, 128), jnp.float16))
