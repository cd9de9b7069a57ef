"""torch_bridge.PagedAttentionBackend on CPU: cache contents and outputs equal kvjax's reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import layout as L

H, HQ, D, N, B = 2, 4, 64, 16, 8
CASES = [(cd, "NHD") for cd in kvjax.CACHE_FORMATS if cd != "nvfp4"] + [
    ("auto", "HND"), ("nvfp4", "HND")]
# three sequences over blocks 5,1 | 2,6,0 | 3; blocks 4 and 7 are never named
SEQ_BLOCKS = [[5, 1], [2, 6, 0], [3]]
SEQ_LENS = [20, 33, 7]
Q_LENS = [1, 4, 3]


def _bf16(rng, shape, scale=1.0):
  return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).bfloat16()


def _jnp(t):
  return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)


def _cache_bytes(t, spec):
  return L.physical_tensor(t, spec).contiguous().reshape(-1).view(torch.uint8).numpy()


def _poison(rng, t, spec):
  flat = L.physical_tensor(t, spec).reshape(-1).view(torch.uint8)
  flat.copy_(torch.from_numpy(rng.integers(0, 256, flat.numel(), dtype=np.uint8)))


def _scales(spec):
  """(torch-side k_scale, v_scale, JAX-side k_scale, v_scale) for formats with global scales."""
  kind = spec.format.kind
  if kind == "fp8_per_tensor":
    return torch.tensor([0.5]), 2.0, jnp.float32(0.5), jnp.float32(2.0)
  if kind == "nvfp4":
    return torch.tensor(0.25), torch.tensor(0.5), jnp.float32(0.25), jnp.float32(0.5)
  return None, None, None, None


def _metadata(slot_mapping):
  qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
  bt = np.array([b + [b[0]] * (3 - len(b)) for b in SEQ_BLOCKS], np.int32)  # pad: a written block
  return tb.PagedAttentionMetadata(
      query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32),
      block_table=torch.from_numpy(bt), slot_mapping=slot_mapping,
      max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS))


def _reference_attention(q, cache, spec, md, ks, vs, **opts):
  fn = jax.jit(lambda q, c: kvjax.reference.unified_attention(
      q, c, spec, query_start_loc=jnp.asarray(md.query_start_loc.numpy()),
      seq_lens=jnp.asarray(md.seq_lens.numpy()), block_table=jnp.asarray(md.block_table.numpy()),
      k_scale=ks, v_scale=vs, **opts))
  return np.asarray(fn(q, cache).astype(jnp.float32))


def _write_all_used_blocks(rng, backend, cache, ts_k, ts_v):
  """One update naming every slot of the used blocks (shuffled, one -1, two padding tokens)."""
  slots = np.concatenate([np.arange(b * N, (b + 1) * N) for bl in SEQ_BLOCKS for b in bl])
  slots = np.insert(rng.permutation(slots), 17, -1)
  t = slots.shape[0]
  key, value = _bf16(rng, (t + 2, H, D)), _bf16(rng, (t + 2, H, D), 3.0)
  backend.do_kv_cache_update(key, value, cache, torch.from_numpy(slots), k_scale=ts_k,
                             v_scale=ts_v)
  return key, value, slots


@pytest.mark.parametrize("cache_dtype,layout", CASES)
def test_update_and_forward_equal_reference(rng, cache_dtype, layout):
  backend = tb.PagedAttentionBackend(HQ, H, D, N, cache_dtype, layout)
  spec = backend.spec
  cache = backend.allocate_kv_cache(B)
  _poison(rng, cache, spec)
  before = jnp.asarray(_cache_bytes(cache, spec).view(spec.storage_dtype)
                       .reshape(spec.physical_shape(B)))
  ptr = cache.data_ptr()
  ts_k, ts_v, js_k, js_v = _scales(spec)
  key, value, slots = _write_all_used_blocks(rng, backend, cache, ts_k, ts_v)
  assert cache.data_ptr() == ptr
  want = jax.jit(lambda c, k, v, s: kvjax.reference.write_kv(c, k, v, s, spec, js_k, js_v))(
      before, _jnp(key), _jnp(value), jnp.asarray(slots))
  np.testing.assert_array_equal(_cache_bytes(cache, spec), np.asarray(want).reshape(-1).view(np.uint8))

  md = _metadata(torch.from_numpy(slots))
  t = sum(Q_LENS) + 1                                   # one padding token at the end
  q = _bf16(rng, (t, HQ, D))
  out = torch.full((t, HQ, D), 7.0, dtype=torch.bfloat16)   # poison: every row must be written
  assert backend.forward(q, cache, md, out, k_scale=ts_k, v_scale=ts_v) is out
  ref = _reference_attention(_jnp(q), want, spec, md, js_k, js_v, scale=D ** -0.5)
  assert np.abs(ref[:-1]).max() > 0.05
  np.testing.assert_allclose(out.float().numpy(), ref, rtol=2e-2, atol=2e-2)
  assert bool((out[-1] == 0).all())


def test_forward_options_and_dlpack_mode(rng):
  sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "HND", scale=0.2, sliding_window=9,
                                     soft_cap=5.0, sinks=sinks, crossing_mode="dlpack")
  spec = backend.spec
  cache = backend.allocate_kv_cache(B)
  _poison(rng, cache, spec)
  key, value, slots = _write_all_used_blocks(rng, backend, cache, None, None)
  md = _metadata(torch.from_numpy(slots))
  qkv = _bf16(rng, (sum(Q_LENS), (HQ + 2 * H) * D))
  q = qkv[:, :HQ * D]                        # vLLM's query: a non-contiguous [T, Hq*D] slice
  out = torch.full((sum(Q_LENS), HQ * D), -3.0, dtype=torch.bfloat16)
  backend.forward(q, cache, md, out)
  ref = _reference_attention(_jnp(q.view(-1, HQ, D)), tb.from_torch(cache, spec), spec, md, None,
                             None, scale=0.2, sliding_window=9, soft_cap=5.0,
                             sinks=jnp.asarray(sinks.numpy()))
  np.testing.assert_allclose(out.view(-1, HQ, D).float().numpy(), ref, rtol=2e-2, atol=2e-2)


def test_cached_views_see_later_torch_writes(rng):
  """The facade keeps JAX views of the cache and metadata: torch's in-place edits stay visible."""
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "NHD")
  spec = backend.spec
  cache = backend.allocate_kv_cache(B)
  _poison(rng, cache, spec)
  _, _, slots = _write_all_used_blocks(rng, backend, cache, None, None)
  md = _metadata(torch.from_numpy(slots))
  q = _bf16(rng, (sum(Q_LENS), HQ, D))
  out = torch.empty((sum(Q_LENS), HQ, D), dtype=torch.bfloat16)
  backend.forward(q, cache, md, out)
  k, v = tb.kv_views(cache, spec)                       # torch edits through vLLM-style views
  v.mul_(-2.0)
  q.mul_(0.5)
  backend.forward(q, cache, md, out)
  ref = _reference_attention(_jnp(q), jnp.asarray(_cache_bytes(cache, spec).view(jnp.bfloat16)
                                                  .reshape(spec.physical_shape(B))),
                             spec, md, None, None, scale=D ** -0.5)
  np.testing.assert_allclose(out.float().numpy(), ref, rtol=2e-2, atol=2e-2)
  # and a second update lands in the same torch memory
  slot = torch.tensor([5 * N + 3], dtype=torch.int32)
  key, value = _bf16(rng, (1, H, D)), _bf16(rng, (1, H, D))
  backend.do_kv_cache_update(key, value, cache, slot)
  np.testing.assert_array_equal(k[5, 3].float().numpy(), key[0].float().numpy())
  np.testing.assert_array_equal(v[5, 3].float().numpy(), value[0].float().numpy())


def test_layout_api_delegates():
  cls = tb.PagedAttentionBackend
  assert cls.get_kv_cache_shape(10, 16, 8, 128) == (10, 8, 16, 256)
  assert cls.get_kv_cache_shape(10, 16, 8, 128, "nvfp4") == (10, 16, 16, 72)
  assert cls.get_kv_cache_shape(1, 16, 1, 1) == (1, 1, 16, 2)
  assert cls.get_kv_cache_stride_order() == (0, 2, 1, 3)
  assert cls.get_kv_cache_stride_order(include_num_layers_dimension=True) == (1, 0, 3, 2, 4)
  hnd = cls(8, 8, 128, 16, layout="HND")
  assert hnd.get_kv_cache_stride_order() == (0, 1, 2, 3)
  assert hnd.get_kv_cache_stride_order(True) == (1, 2, 0, 3, 4)
  cache = hnd.allocate_kv_cache(3)
  assert tuple(cache.shape) == (3, 8, 16, 256) and cache.is_contiguous()
  fp8 = cls(8, 8, 128, 16, "fp8").allocate_kv_cache(3)
  assert fp8.dtype == torch.uint8 and fp8.stride() == (32768, 256, 2048, 1)
  assert fp8.data_ptr() % 64 == 0 and bool((fp8 == 0).all())
  with pytest.raises(ValueError, match="block_size"):
    cls.get_kv_cache_shape(10, 8, 8, 128)


def test_backend_refusals(rng):
  with pytest.raises(ValueError, match="num_heads"):
    tb.PagedAttentionBackend(3, 2, D, N)
  with pytest.raises(ValueError, match="HND"):
    tb.PagedAttentionBackend(HQ, H, D, N, "nvfp4", "NHD")
  with pytest.raises(ValueError, match="crossing_mode"):
    tb.PagedAttentionBackend(HQ, H, D, N, crossing_mode="slow")
  with pytest.raises(ValueError, match="output_mode"):
    tb.PagedAttentionBackend(HQ, H, D, N, output_mode="alias")
  with pytest.raises(ValueError, match="sinks"):
    tb.PagedAttentionBackend(HQ, H, D, N, sinks=torch.zeros(3))
  backend = tb.PagedAttentionBackend(HQ, H, D, N)
  cache = backend.allocate_kv_cache(B)
  key = _bf16(rng, (4, H, D))
  slots = torch.arange(4, dtype=torch.int32)
  with pytest.raises(TypeError, match="dtype"):
    backend.do_kv_cache_update(key.float(), key.float(), cache, slots)
  with pytest.raises(ValueError, match=r"must be \[T, 2, 64\]"):
    backend.do_kv_cache_update(key[:, :1], key[:, :1], cache, slots)
  k_half, _ = tb.kv_views(cache, backend.spec)
  with pytest.raises(ValueError, match="non-compact"):
    backend.do_kv_cache_update(key, key, k_half, slots)
  with pytest.raises(TypeError, match="slot_mapping"):
    backend.do_kv_cache_update(key, key, cache, slots.float())
  with pytest.raises(ValueError, match="slot"):
    backend.do_kv_cache_update(key[:2], key[:2], cache, slots)
  with pytest.raises(TypeError, match="dtype"):
    backend.do_kv_cache_update(key, key, cache.float(), slots)
  md = _metadata(slots)
  q = _bf16(rng, (8, HQ, D))
  with pytest.raises(TypeError, match="metadata"):
    backend.forward(q, cache, {"seq_lens": 1}, torch.empty_like(q))
  with pytest.raises(ValueError, match="tokens"):
    backend.forward(q, cache, md, torch.empty_like(q[:3]))
  with pytest.raises(TypeError, match="dtype"):
    backend.forward(q, cache, md, torch.empty_like(q).half())
  with pytest.raises(TypeError, match="int32 or int64"):
    tb.PagedAttentionMetadata(md.query_start_loc.float(), md.seq_lens, md.block_table,
                              md.slot_mapping, 4, 33)
  with pytest.raises(ValueError, match="disagree"):
    tb.PagedAttentionMetadata(md.query_start_loc, md.seq_lens[:2], md.block_table,
                              md.slot_mapping, 4, 33)
  raw = torch.zeros(int(np.prod(backend.spec.physical_shape(B))) + 64, dtype=torch.bfloat16)
  skip = (-raw.data_ptr() % 64) // 2 + 1
  misaligned = raw[skip:skip + raw.numel() - 64].view(backend.spec.physical_shape(B))
  with pytest.raises(ValueError, match="64"):
    backend.forward(q, misaligned, md, torch.empty_like(q))
