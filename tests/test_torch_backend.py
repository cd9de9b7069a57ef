"""torch_bridge.PagedAttentionBackend on CPU and on CUDA (when present): cache bytes and
outputs equal kvjax's reference computed on the CPU; writes land in torch's memory; on CUDA,
stream ordering and the opt-in input checks."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from kv_testing import assert_written_as_reference
from torch_testing import (cache_array, device, on_cpu, poison,  # noqa: F401
                           rand_bf16, requires_cuda, sync, to_jnp)

H, HQ, D, N, B = 2, 4, 64, 16, 8
CASES = [(cd, "NHD") for cd in kvjax.CACHE_FORMATS if cd != "nvfp4"] + [
    ("auto", "HND"), ("nvfp4", "HND")]
# three sequences over blocks 5,1 | 2,6,0 | 3; blocks 4 and 7 are never named
SEQ_BLOCKS = [[5, 1], [2, 6, 0], [3]]
UNTOUCHED = [4, 7]
SEQ_LENS = [20, 33, 7]
Q_LENS = [1, 4, 3]


def _scales(spec, device):
  """(torch-side k_scale, v_scale, JAX-side k_scale, v_scale) for formats with global scales."""
  kind = spec.format.kind
  if kind == "fp8_per_tensor":
    return torch.tensor([0.5], device=device), 2.0, jnp.float32(0.5), jnp.float32(2.0)
  if kind == "nvfp4":
    return (torch.tensor(0.25, device=device), torch.tensor(0.5, device=device),
            jnp.float32(0.25), jnp.float32(0.5))
  return None, None, None, None


def _metadata(slot_mapping, device):
  qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
  bt = np.array([b + [b[0]] * (3 - len(b)) for b in SEQ_BLOCKS], np.int32)  # pad: a written block
  return tb.PagedAttentionMetadata(
      query_start_loc=torch.from_numpy(qsl).to(device),
      seq_lens=torch.tensor(SEQ_LENS, dtype=torch.int32, device=device),
      block_table=torch.from_numpy(bt).to(device), slot_mapping=slot_mapping,
      max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS))


def _reference_attention(q, cache, spec, md, ks, vs, **opts):
  meta = {n: on_cpu(getattr(md, n).cpu().numpy())
          for n in ("query_start_loc", "seq_lens", "block_table")}
  fn = jax.jit(lambda q, c: kvjax.unified_attention(q, c, spec, k_scale=ks, v_scale=vs, **meta,
                                                     impl="reference", **opts))
  return np.asarray(fn(q, cache).astype(jnp.float32))


def _write_all_used_blocks(rng, backend, cache, ts_k, ts_v):
  """One update naming every slot of the used blocks (shuffled, one -1, two padding tokens)."""
  slots = np.concatenate([np.arange(b * N, (b + 1) * N) for bl in SEQ_BLOCKS for b in bl])
  slots = np.insert(rng.permutation(slots), 17, -1)
  t = slots.shape[0]
  key = rand_bf16(rng, (t + 2, H, D), cache.device)
  value = rand_bf16(rng, (t + 2, H, D), cache.device, scale=3.0)
  backend.do_kv_cache_update(key, value, cache, torch.from_numpy(slots).to(cache.device),
                             k_scale=ts_k, v_scale=ts_v)
  return key, value, slots


def _facade_warnings(caught):
  return [str(w.message) for w in caught if "torch_bridge" in str(w.message)]


def _assert_cache_equals(cache, want, spec, device, slots):
  del device
  assert_written_as_reference(cache_array(cache, spec), want, spec, slots)


@pytest.mark.parametrize("cache_dtype,layout", CASES)
def test_update_and_forward_equal_reference(rng, device, cache_dtype, layout):
  backend = tb.PagedAttentionBackend(HQ, H, D, N, cache_dtype, layout)
  spec = backend.spec
  cache = backend.allocate_kv_cache(B, device=device)
  poison(rng, cache, spec)
  before = cache_array(cache, spec)
  ptr = cache.data_ptr()
  ts_k, ts_v, js_k, js_v = _scales(spec, device)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    key, value, slots = _write_all_used_blocks(rng, backend, cache, ts_k, ts_v)
  assert cache.data_ptr() == ptr and not _facade_warnings(caught)   # in place, never copied
  want = jax.jit(lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, k_scale=js_k, v_scale=js_v,
                                                   impl="reference"))(
      before, to_jnp(key), to_jnp(value), on_cpu(slots))
  _assert_cache_equals(cache, want, spec, device, slots)

  md = _metadata(torch.from_numpy(slots).to(device), device)
  t = sum(Q_LENS) + 1                                   # one padding token at the end
  q = rand_bf16(rng, (t, HQ, D), device)
  out = torch.full((t, HQ, D), 7.0, dtype=torch.bfloat16, device=device)  # poison: rows written
  out_ptr = out.data_ptr()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert backend.forward(q, cache, md, out, k_scale=ts_k, v_scale=ts_v) is out
  assert out.data_ptr() == out_ptr and not _facade_warnings(caught)
  ref = _reference_attention(to_jnp(q), cache_array(cache, spec), spec, md, js_k, js_v,
                             scale=D ** -0.5)
  assert np.abs(ref[:-1]).max() > 0.05
  sync(device)
  np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=2e-2, atol=2e-2)
  assert bool((out[-1] == 0).all())


@pytest.mark.parametrize("output_mode", ["copy", "donate"])
def test_forward_options_and_dlpack_mode(rng, device, output_mode):
  sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "HND", scale=0.2, sliding_window=9,
                                     soft_cap=5.0, sinks=sinks, crossing_mode="dlpack",
                                     output_mode=output_mode)
  spec = backend.spec
  cache = backend.allocate_kv_cache(B, device=device)
  poison(rng, cache, spec)
  _, _, slots = _write_all_used_blocks(rng, backend, cache, None, None)
  md = _metadata(torch.from_numpy(slots).to(device), device)
  qkv = rand_bf16(rng, (sum(Q_LENS), (HQ + 2 * H) * D), device)
  q = qkv[:, :HQ * D]                        # vLLM's query: a non-contiguous [T, Hq*D] slice
  out = torch.full((sum(Q_LENS), HQ * D), -3.0, dtype=torch.bfloat16, device=device)
  backend.forward(q, cache, md, out)
  ref = _reference_attention(to_jnp(q.reshape(-1, HQ, D)), cache_array(cache, spec), spec, md,
                             None, None, scale=0.2, sliding_window=9, soft_cap=5.0,
                             sinks=on_cpu(sinks.cpu().numpy()))
  sync(device)
  np.testing.assert_allclose(out.view(-1, HQ, D).float().cpu().numpy(), ref, rtol=2e-2,
                             atol=2e-2)


def test_cached_views_see_later_torch_writes(rng, device):
  """The facade keeps JAX views of the cache and metadata: torch's in-place edits stay visible."""
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "NHD")
  spec = backend.spec
  cache = backend.allocate_kv_cache(B, device=device)
  poison(rng, cache, spec)
  _, _, slots = _write_all_used_blocks(rng, backend, cache, None, None)
  md = _metadata(torch.from_numpy(slots).to(device), device)
  q = rand_bf16(rng, (sum(Q_LENS), HQ, D), device)
  out = torch.empty((sum(Q_LENS), HQ, D), dtype=torch.bfloat16, device=device)
  backend.forward(q, cache, md, out)
  k, v = tb.kv_views(cache, spec)                       # torch edits through vLLM-style views
  v.mul_(-2.0)
  q.mul_(0.5)
  backend.forward(q, cache, md, out)
  ref = _reference_attention(to_jnp(q), cache_array(cache, spec), spec, md, None, None,
                             scale=D ** -0.5)
  sync(device)
  np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=2e-2, atol=2e-2)
  # and a second update lands in the same torch memory
  slot = torch.tensor([5 * N + 3], dtype=torch.int32, device=device)
  key, value = rand_bf16(rng, (1, H, D), device), rand_bf16(rng, (1, H, D), device)
  backend.do_kv_cache_update(key, value, cache, slot)
  sync(device)
  assert torch.equal(k[5, 3], key[0]) and torch.equal(v[5, 3], value[0])


@requires_cuda
@pytest.mark.parametrize("mode,side_stream,output_mode,sliced", [
    ("fast", True, "copy", False), ("fast", False, "copy", False),
    ("dlpack", True, "copy", False), ("fast", True, "donate", False),
    ("dlpack", False, "donate", False), ("fast", True, "donate", True),
    ("fast", False, "copy", True)])
def test_cuda_stream_ordering(rng, mode, side_stream, output_mode, sliced):
  """torch writes queued behind a long GPU sleep on the current stream are seen by the facade;
  torch work queued right after a facade call sees its results (the host never waits).
  ``sliced``: query and key are non-contiguous views (vLLM slices them out of one qkv
  tensor), so the facade's contiguous copies are torch work queued behind the sleep too."""
  dev = torch.device("cuda")
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "NHD", crossing_mode=mode,
                                     output_mode=output_mode)
  spec = backend.spec
  cache = backend.allocate_kv_cache(B, device=dev)
  poison(rng, cache, spec)
  _, _, slots = _write_all_used_blocks(rng, backend, cache, None, None)
  md = _metadata(torch.from_numpy(slots).to(dev), dev)
  t = sum(Q_LENS)
  q_true, k_true = rand_bf16(rng, (t, HQ, D), dev), rand_bf16(rng, (1, H, D), dev)
  if sliced:
    q = torch.zeros((t, (HQ + 2 * H) * D), dtype=torch.bfloat16, device=dev)[:, :HQ * D]
    q = q.view(t, HQ, D)
    key = torch.zeros((1, H, 2 * D), dtype=torch.bfloat16, device=dev)[:, :, :D]
    assert not q.is_contiguous() and not key.is_contiguous()
  else:
    q, key = torch.zeros_like(q_true), torch.zeros_like(k_true)
  out = torch.zeros_like(q_true)
  one_slot = torch.tensor([5 * N + 2], dtype=torch.int32, device=dev)   # block 5, offset 2
  sync(dev)
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  with torch.cuda.stream(stream):
    backend.forward(q, cache, md, out)                      # compile both ops first
    backend.do_kv_cache_update(key, key, cache, one_slot)
    sync(dev)
    torch.cuda._sleep(200_000_000)                          # GPU spin before the writes below
    q.copy_(q_true)
    key.copy_(k_true)
    backend.do_kv_cache_update(key, key, cache, one_slot)   # sees key written after the sleep
    k_view, v_view = tb.kv_views(cache, spec)
    k_read = k_view[5, 2].clone()                           # torch reads the JAX write
    torch.cuda._sleep(100_000_000)
    v_view[3].mul_(-1.0)                                    # torch edits the cache in place
    backend.forward(q, cache, md, out)                      # sees q and the edit
    y = out.float() * 1.0                                   # torch consumes the output
  sync(dev)
  assert torch.equal(k_read, k_true[0])
  ref = _reference_attention(to_jnp(q_true), cache_array(cache, spec), spec, md, None, None,
                             scale=D ** -0.5)
  np.testing.assert_allclose(y.cpu().numpy(), ref, rtol=2e-2, atol=2e-2)


@requires_cuda
def test_cuda_inputs_checked_only_on_request(rng):
  """CUDA slot mappings and metadata are read on the host (a sync) only with
  check_cuda_inputs=True; without it, slots past the end are dropped and int64 slots are
  narrowed by saturation, so nothing wraps."""
  dev = torch.device("cuda")
  strict = tb.PagedAttentionBackend(HQ, H, D, N, check_cuda_inputs=True)
  spec = strict.spec
  cache = strict.allocate_kv_cache(B, device=dev)
  poison(rng, cache, spec)
  key = rand_bf16(rng, (4, H, D), dev)
  past = torch.tensor([3, B * N + 5, 2**32 + 7, -(2**32) + 9], device=dev)   # int64
  with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 4294967303"):
    strict.do_kv_cache_update(key, key, cache, past)
  bad_md = _metadata(torch.arange(8, device=dev), dev)
  bad_md = tb.PagedAttentionMetadata(bad_md.query_start_loc, bad_md.seq_lens,
                                     bad_md.block_table + B, bad_md.slot_mapping, 4, 33)
  q = rand_bf16(rng, (sum(Q_LENS), HQ, D), dev)
  with pytest.raises(ValueError, match="block_table"):
    strict.forward(q, cache, bad_md, torch.empty_like(q))
  lax = tb.PagedAttentionBackend(HQ, H, D, N)
  before = cache_array(cache, spec)
  lax.do_kv_cache_update(key, key, cache, past)
  want = kvjax.reference.write_kv(before, to_jnp(key), to_jnp(key),
                                  on_cpu(np.array([3, -1, -1, -1], np.int32)), spec)
  _assert_cache_equals(cache, want, spec, dev, np.array([3]))


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
  key = rand_bf16(rng, (4, H, D))
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
  with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
    backend.do_kv_cache_update(key, key, cache, [0, 1, 2, 3])
  with pytest.raises(ValueError, match="slot"):
    backend.do_kv_cache_update(key[:2], key[:2], cache, slots)
  with pytest.raises(TypeError, match="dtype"):
    backend.do_kv_cache_update(key, key, cache.float(), slots)
  md = _metadata(slots, "cpu")
  q = rand_bf16(rng, (8, HQ, D))
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


def _float32_step_errors(rng, device):
  """Max |facade - float32 reference| / max |reference| of one ragged float32 step, under
  torch's float32 matmul precision "highest" and "high" ({setting: error})."""
  backend = tb.PagedAttentionBackend(HQ, H, D, N, "auto", "NHD", dtype=torch.float32)
  cache = backend.allocate_kv_cache(B, device=device)
  spec = backend.spec
  slots = np.concatenate([np.arange(b * N, (b + 1) * N) for bl in SEQ_BLOCKS for b in bl])
  k, v = (torch.from_numpy(rng.standard_normal((slots.size, H, D)).astype(np.float32)).to(device)
          for _ in range(2))
  backend.do_kv_cache_update(k, v, cache, torch.from_numpy(slots).to(device))
  md = _metadata(torch.zeros(sum(Q_LENS), dtype=torch.int64, device=device), device)
  q = torch.from_numpy(3 * rng.standard_normal((sum(Q_LENS), HQ, D)).astype(np.float32)).to(device)
  sync(device)
  with jax.default_matmul_precision("highest"):      # the reference: true float32 on the CPU
    want = _reference_attention(on_cpu(q.cpu().numpy()), cache_array(cache, spec), spec, md,
                                None, None, scale=backend.scale)
  saved, errors = torch.get_float32_matmul_precision(), {}
  try:
    for setting in ("highest", "high"):
      torch.set_float32_matmul_precision(setting)
      out = torch.empty_like(q)
      backend.forward(q, cache, md, out)
      errors[setting] = float(np.abs(out.cpu().numpy() - want).max() / np.abs(want).max())
  finally:
    torch.set_float32_matmul_precision(saved)
  return errors


def test_float32_model_precision_follows_torch(rng, device):
  """A float32 model and cache: with torch's default "highest" the facade computes in true
  float32 (error at float32 rounding); on CUDA "high" (TensorFloat-32) is visibly coarser,
  as torch's own float32 matmuls would be."""
  errors = _float32_step_errors(rng, device)
  print(f"float32 step on {device}: max rel. error vs float32 reference {errors}")
  assert errors["highest"] < 2e-5
  if torch.device(device).type == "cuda":
    assert errors["high"] > 4 * errors["highest"] and errors["high"] < 5e-2
