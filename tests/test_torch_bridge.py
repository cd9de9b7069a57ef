"""torch_bridge: zero-copy to_torch / from_torch (CPU, and CUDA when present), and torch views
equal to vLLM's formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import layout as L
from torch_testing import cache_bytes, device, jax_bytes, sync  # noqa: F401

ALL_CASES = [(cd, "NHD") for cd in kvjax.CACHE_FORMATS if cd != "nvfp4"] + [
    ("auto", "HND"), ("int8_per_token_head", "HND"), ("nvfp4", "HND")]


def _spec(cache_dtype, layout, h=2, d=64, n=16):
  return kvjax.KVCacheSpec(h, d, n, cache_dtype, layout)


def _fill(rng, t, spec):
  """Fill cache tensor ``t``'s physical buffer with random bytes (in place)."""
  flat = L.physical_tensor(t, spec).reshape(-1).view(torch.uint8)
  flat.copy_(torch.from_numpy(rng.integers(0, 256, flat.numel(), dtype=np.uint8)).to(t.device))
  sync(t.device)


def _jax_device(device):
  return tb.dlpack.jax_device_of(torch.empty(0, device=device))


# -- to_torch -------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype,layout", ALL_CASES)
def test_to_torch_shares_memory_with_logical_view(rng, device, cache_dtype, layout):
  spec = _spec(cache_dtype, layout)
  raw = rng.integers(0, 256, (5 * spec.page_bytes,), dtype=np.uint8)
  cache = jax.device_put(raw.view(spec.storage_dtype).reshape(spec.physical_shape(5)),
                         _jax_device(device))
  t = tb.to_torch(cache, spec)
  assert t.data_ptr() == cache.unsafe_buffer_pointer() and t.device.type == device.type
  assert tuple(t.shape) == spec.logical_shape(5)
  assert t.stride() == spec.logical_strides(5)
  fp8 = spec.format.kind == "fp8_per_tensor"
  assert t.dtype == (torch.uint8 if fp8 else tb.dtypes.torch_dtype(spec.storage_dtype))
  np.testing.assert_array_equal(cache_bytes(t, spec), raw)
  # a torch write is seen through the JAX array (same bytes)
  flat = L.physical_tensor(t, spec).reshape(-1).view(torch.uint8)
  flat[:7] = torch.arange(1, 8, dtype=torch.uint8, device=device)
  sync(device)
  np.testing.assert_array_equal(jax_bytes(cache)[:7], np.arange(1, 8))


def test_to_torch_fp8_raw_dtype_and_refusals(rng):
  spec = _spec("fp8_e5m2", "NHD")
  cache = jnp.asarray(rng.standard_normal(spec.physical_shape(2)), jnp.float8_e5m2)
  t = tb.to_torch(cache, spec, as_uint8=False)
  assert t.dtype == torch.float8_e5m2 and t.data_ptr() == cache.unsafe_buffer_pointer()
  np.testing.assert_array_equal(t.float().permute(0, 2, 1, 3).cpu().numpy(),
                                np.asarray(cache.astype(jnp.float32)))
  with pytest.raises(ValueError, match="as_uint8"):
    tb.to_torch(jnp.zeros(_spec("auto", "NHD").physical_shape(2), jnp.bfloat16),
                _spec("auto", "NHD"), as_uint8=True)
  with pytest.raises(ValueError, match="shape"):
    tb.to_torch(jnp.zeros((2, 16, 3, 128), jnp.bfloat16), _spec("auto", "NHD"))
  with pytest.raises(TypeError):
    tb.to_torch(np.zeros(spec.physical_shape(2), np.uint8), spec)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_to_and_from_torch_with_layers_dim(rng, device, layout):
  spec = _spec("auto", layout)
  t = tb.empty_cache(spec, 3, num_layers=2, device=device)
  assert tuple(t.shape) == spec.logical_shape(3, 2)
  assert t.stride() == spec.logical_strides(3, 2)
  _fill(rng, t, spec)
  j = tb.from_torch(t, spec)
  assert j.shape == spec.physical_shape(3, 2) and j.unsafe_buffer_pointer() == t.data_ptr()
  back = tb.to_torch(j, spec)
  assert back.data_ptr() == t.data_ptr() and back.stride() == t.stride()
  np.testing.assert_array_equal(jax_bytes(j), cache_bytes(t, spec))


# -- from_torch -----------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype,layout", ALL_CASES)
def test_from_torch_is_zero_copy_both_views(rng, device, cache_dtype, layout):
  spec = _spec(cache_dtype, layout)
  t = tb.empty_cache(spec, 4, device=device)
  _fill(rng, t, spec)
  for given in (t, L.physical_tensor(t, spec)):
    j = tb.from_torch(given, spec)
    assert j.shape == spec.physical_shape(4) and j.dtype == spec.storage_dtype
    assert j.unsafe_buffer_pointer() == t.data_ptr()
    assert j.devices() == {_jax_device(device)}
    np.testing.assert_array_equal(jax_bytes(j), cache_bytes(t, spec))
  # a torch in-place edit after the import is visible through the JAX array
  j = tb.from_torch(t, spec)
  flat = L.physical_tensor(t, spec).reshape(-1).view(torch.uint8)
  new = torch.from_numpy(rng.integers(0, 256, 64, dtype=np.uint8))
  flat[-64:] = new.to(device)
  sync(device)
  np.testing.assert_array_equal(jax_bytes(j)[-64:], new.cpu().numpy())


def test_from_torch_fp8_uint8_is_reinterpreted_without_copy(rng, device):
  spec = _spec("fp8", "NHD")
  t = tb.empty_cache(spec, 2, device=device)
  assert t.dtype == torch.uint8
  vals = torch.from_numpy(rng.standard_normal(tuple(t.shape), np.float32)).to(torch.float8_e4m3fn)
  t.copy_(vals.view(torch.uint8).to(device))
  sync(device)
  j = tb.from_torch(t, spec)
  assert j.dtype == jnp.float8_e4m3fn and j.unsafe_buffer_pointer() == t.data_ptr()
  np.testing.assert_array_equal(np.asarray(j.astype(jnp.float32)),
                                vals.float().permute(0, 2, 1, 3).cpu().numpy())
  j2 = tb.from_torch(t.view(torch.float8_e4m3fn), spec)   # the fp8-typed view works too
  assert j2.unsafe_buffer_pointer() == t.data_ptr()


def _misaligned(spec, b):
  """A correctly shaped physical CPU tensor whose address is 1 element past a 64-byte boundary."""
  shape = spec.physical_shape(b)
  n = int(np.prod(shape))
  dt = tb.dtypes.cache_torch_dtype(spec)
  raw = torch.zeros(n + 64, dtype=dt)
  skip = (-raw.data_ptr() % 64) // raw.element_size() + 1
  return raw[skip:skip + n].view(shape)


def test_from_torch_refuses_what_it_cannot_share(rng):
  spec = _spec("auto", "NHD")
  t = tb.empty_cache(spec, 3)
  k, _ = tb.kv_views(t, spec)
  with pytest.raises(ValueError, match="non-compact"):
    tb.from_torch(k, spec)                          # a K half
  with pytest.raises(ValueError, match="non-compact"):
    tb.from_torch(t[:, :1], spec)                   # one head of NHD
  with pytest.raises(ValueError, match="non-compact"):
    tb.from_torch(t[::2], spec)                     # every other block
  with pytest.raises(ValueError, match="64"):
    tb.from_torch(_misaligned(spec, 3), spec)       # JAX would copy
  with pytest.raises(TypeError, match="dtype"):
    tb.from_torch(t.float(), spec)
  with pytest.raises(TypeError, match="dtype"):
    tb.from_torch(tb.empty_cache(_spec("fp8", "NHD"), 3), _spec("int8_per_token_head", "NHD"))
  with pytest.raises(ValueError, match="logical view"):
    tb.from_torch(tb.empty_cache(_spec("auto", "NHD", h=4), 3), spec)   # wrong head count
  with pytest.raises(ValueError, match="logical view"):
    tb.from_torch(tb.empty_cache(_spec("auto", "HND"), 3), spec)        # HND strides, NHD spec
  with pytest.raises(ValueError, match="4-D"):
    tb.from_torch(t[0], spec)
  with pytest.raises(ValueError, match="device"):
    tb.from_torch(torch.empty(spec.physical_shape(3), dtype=torch.bfloat16, device="meta"), spec)
  with pytest.raises(TypeError, match="torch.Tensor"):
    tb.from_torch(np.zeros(spec.physical_shape(3)), spec)


def test_empty_cache_is_aligned_and_fill(rng):
  spec = _spec("int4_per_token_head", "HND")
  t = tb.empty_cache(spec, 3, fill=7)
  assert t.data_ptr() % 64 == 0 and t.dtype == torch.uint8
  assert bool((t == 7).all())


# -- views ----------------------------------------------------------------------------------
def _vllm_kv(logical, width):
  return logical.transpose(1, 2).split(width, -1)


def _same_view(a, b):
  assert tuple(a.shape) == tuple(b.shape)
  assert a.stride() == b.stride()
  assert a.storage_offset() == b.storage_offset()
  assert a.dtype == b.dtype


@pytest.mark.parametrize("layout,strides", [("NHD", (32768, 2048, 256, 1)),
                                            ("HND", (32768, 256, 4096, 1))])
def test_kv_views_spec_numbers(layout, strides):
  spec = kvjax.KVCacheSpec(8, 128, 16, "auto", layout)
  t = tb.empty_cache(spec, 10)
  k, v = tb.kv_views(t, spec)
  assert tuple(k.shape) == (10, 16, 8, 128) and k.stride() == strides and v.stride() == strides
  assert k.storage_offset() == 0 and v.storage_offset() == 128


@pytest.mark.parametrize("cache_dtype,layout", [c for c in ALL_CASES if c[0] != "nvfp4"])
def test_kv_views_equal_vllm_formula(rng, cache_dtype, layout):
  spec = _spec(cache_dtype, layout)
  t = tb.empty_cache(spec, 3)
  _fill(rng, t, spec)
  for base in (t, t[1:]):     # also a block slice (non-zero storage offset)
    k, v = tb.kv_views(base, spec)
    ek, ev = _vllm_kv(base, spec.padded_head_size)
    _same_view(k, ek)
    _same_view(v, ev)
    assert torch.equal(k.view(torch.uint8) if k.dtype != torch.uint8 else k,
                       ek.view(torch.uint8) if ek.dtype != torch.uint8 else ek)


def test_scale_views_spec_numbers():
  spec = kvjax.KVCacheSpec(2, 128, 16, "int8_per_token_head", "NHD")
  t = tb.empty_cache(spec, 3)
  assert t.stride() == (8448, 264, 528, 1)
  k, v = tb.kv_views(t, spec)
  assert tuple(k.shape) == (3, 16, 2, 132) and k.stride() == (8448, 528, 264, 1)
  ks, vs = tb.kv_scale_views(t, spec)
  assert ks.dtype == torch.float32 and tuple(ks.shape) == (3, 16, 2)
  assert ks.stride() == (2112, 132, 66) and vs.stride() == (2112, 132, 66)
  assert ks.storage_offset() == 32 and vs.storage_offset() == 65


@pytest.mark.parametrize("cache_dtype,layout", [("int8_per_token_head", "NHD"),
                                                ("fp8_per_token_head", "HND"),
                                                ("int4_per_token_head", "NHD")])
def test_scale_views_read_the_scale_slots(rng, cache_dtype, layout):
  spec = _spec(cache_dtype, layout)
  t = tb.empty_cache(spec, 3)
  _fill(rng, t, spec)
  ks, vs = tb.kv_scale_views(t, spec)
  jk, jv = kvjax.kv_scale_views(tb.from_torch(t, spec), spec)
  np.testing.assert_array_equal(ks.cpu().numpy().view(np.uint32), np.asarray(jk).view(np.uint32))
  np.testing.assert_array_equal(vs.cpu().numpy().view(np.uint32), np.asarray(jv).view(np.uint32))
  # writing through the torch view lands in the cache's scale slot
  ks[1, 2, 1] = 0.125
  rows = L.physical_tensor(t, spec)
  row = rows[1, 2, 1] if layout == "NHD" else rows[1, 1, 2]
  dd = spec.data_dim
  assert row[dd:spec.padded_head_size].contiguous().view(torch.float32).item() == 0.125
  with pytest.raises(ValueError, match="per-token-head"):
    tb.kv_scale_views(tb.empty_cache(_spec("fp8", "NHD"), 2), _spec("fp8", "NHD"))


def test_nvfp4_split_spec_numbers():
  spec = kvjax.KVCacheSpec(8, 128, 16, "nvfp4", "HND")
  t = tb.empty_cache(spec, 5)
  assert tuple(t.shape) == (5, 16, 16, 72) and t.stride() == (18432, 1152, 72, 1)
  kside, vside = tb.nvfp4_sides(t, spec)
  kd, ksf = tb.nvfp4_split_data_scale(kside)
  assert tuple(kd.shape) == (5, 8, 16, 64) and kd.stride() == (18432, 1024, 64, 1)
  assert kd.storage_offset() == 0 and kd.dtype == torch.uint8
  assert tuple(ksf.shape) == (5, 8, 16, 8) and ksf.stride() == (18432, 128, 8, 1)
  assert ksf.storage_offset() == 8192 and ksf.dtype == torch.float8_e4m3fn
  vd, vsf = tb.nvfp4_split_data_scale(vside)
  assert vd.storage_offset() == 9216 and vsf.storage_offset() == 9216 + 8192
  for got, want in zip(tb.nvfp4_views(t, spec), (kd, ksf, vd, vsf)):
    _same_view(got, want)


def test_nvfp4_views_match_kvjax_split(rng):
  spec = _spec("nvfp4", "HND")
  t = tb.empty_cache(spec, 3)
  _fill(rng, t, spec)
  j = tb.from_torch(t, spec)
  jk, jv = kvjax.nvfp4_sides(j, spec)
  views = tb.nvfp4_views(t, spec)
  for (d, sf), side in zip((views[:2], views[2:]), (jk, jv)):
    jd, jsf = kvjax.nvfp4_split_data_scale(side)
    np.testing.assert_array_equal(d.cpu().numpy(), np.asarray(jd))
    np.testing.assert_array_equal(sf.view(torch.uint8).cpu().numpy(), np.asarray(jsf).view(np.uint8))
  with pytest.raises(ValueError, match="contiguous"):
    tb.nvfp4_split_data_scale(t[:, :2].transpose(1, 2))    # not a contiguous (d1, d2) block
  with pytest.raises(ValueError, match="uint8"):
    tb.nvfp4_split_data_scale(t[:, :2].float())
  with pytest.raises(ValueError, match="nvfp4"):
    tb.kv_views(t, spec)


# -- the facade's crossing (torch_bridge.interop) -------------------------------------------
@pytest.mark.parametrize("mode", ["fast", "dlpack"])
def test_crossing_imports_and_hands_back_without_copies(rng, device, mode):
  """fresh / view import torch's memory (a non-contiguous or grad-requiring tensor as its
  contiguous values), and to_torch hands a JAX result back in its own buffer, ordered on the
  stream the fence returned."""
  from torch_bridge import interop
  cx = interop.Crossing(device, mode)
  raw = torch.empty(6 * 4 * 8 + 16, device=device)    # 64-byte aligned: shareable on CPU
  skip = -raw.data_ptr() % L.CPU_ALIGNMENT // raw.element_size()
  x = raw[skip:skip + 6 * 4 * 8].view(6, 4, 8)
  x.copy_(torch.from_numpy(rng.standard_normal((6, 4, 8)).astype(np.float32)))
  stream = cx.fence()
  assert (stream is None) == (torch.device(device).type == "cpu")
  kept = cx.view(x)
  assert kept.unsafe_buffer_pointer() == x.data_ptr() and cx.view(x) is kept
  for t in (x, x.transpose(0, 1), x.clone().requires_grad_()):
    got = cx.fresh(t)
    np.testing.assert_array_equal(np.asarray(got), t.detach().cpu().numpy())
  result = jax.jit(lambda a: a * 2.0 + 1.0)(kept)
  back = cx.to_torch(result, stream)
  assert back.data_ptr() == result.unsafe_buffer_pointer()
  np.testing.assert_array_equal(back.cpu().numpy(), x.cpu().numpy() * 2.0 + 1.0)
  cx.publish(result, stream)
  x.mul_(-1.0)                              # torch's in-place write, seen through the view
  sync(device)
  np.testing.assert_array_equal(np.asarray(cx.view(x)), x.cpu().numpy())


def test_crossing_export_falls_back_to_dlpack_protocol(rng, monkeypatch):
  """If jaxlib's raw export fails on first use, the crossing exports with __dlpack__ for good
  (same memory, same values); a conjugated tensor, which DLPack cannot carry, is refused."""
  from torch_bridge import interop
  to_buffer, _ = interop._jaxlib_entry_points()

  def broken(*args, **kwargs):
    raise TypeError("no such entry point")
  monkeypatch.setattr(interop, "_jaxlib_entry_points", lambda: (to_buffer, broken))
  cx = interop.Crossing("cpu")
  x = torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32))
  result = jax.jit(lambda a: a - 3.0)(cx.fresh(x))
  back = cx.to_torch(result)
  assert cx._export_checked is None and back.data_ptr() == result.unsafe_buffer_pointer()
  np.testing.assert_array_equal(back.numpy(), x.numpy() - 3.0)
  with pytest.raises(BufferError, match="conjugate"):
    cx.fresh(torch.from_numpy(rng.standard_normal(4).astype(np.complex64)).conj())
