"""Layered (cross-layer) torch caches through the facade and the vLLM-convention adapter.

One tensor holds every layer (``allocate_kv_cache(B, num_layers=L)``); the facade takes it whole
with ``layer=``. Checked on CPU (and on CUDA where present), poisoned caches, fresh data: writes
change only the named rows of that layer, attention equals kvjax's reference on that layer's
bytes, every layer shares one compiled program, and the wrong slices are refused.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import layout as L
from torch_bridge import vllm_adapter as va
from torch_testing import cache_bytes, device, on_cpu, poison, rand_bf16, sync, to_jnp  # noqa: F401

H, HQ, D, N, B, LAYERS = 2, 4, 32, 16, 6, 3
SEQ_BLOCKS = [[4, 1], [2, 5, 0]]
SEQ_LENS, Q_LENS = [20, 33], [1, 5]


def _layer_bytes(cache, spec, layer):
  """The physical bytes of one layer of a layered torch cache, as the spec's 4-D numpy array."""
  phys = L.physical_tensor(cache, spec)
  raw = cache_bytes(cache, spec).view(spec.storage_dtype).reshape(phys.shape)
  return np.take(raw, layer, axis=spec.layer_axis)


def _metadata(device):
  qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
  bt = np.array([b + [b[0]] * (3 - len(b)) for b in SEQ_BLOCKS], np.int32)
  as_t = lambda a: torch.from_numpy(np.asarray(a)).to(device)
  return tb.PagedAttentionMetadata(as_t(qsl), as_t(np.asarray(SEQ_LENS, np.int32)), as_t(bt),
                                   as_t(np.zeros(1, np.int32)), max_query_len=max(Q_LENS),
                                   max_seq_len=max(SEQ_LENS))


@pytest.mark.parametrize("cache_dtype,layout", [("auto", "NHD"), ("auto", "HND"),
                                                ("int8_per_token_head", "NHD"),
                                                ("fp8", "HND")])
def test_facade_on_each_layer_of_a_layered_cache(rng, device, cache_dtype, layout):
  backend = tb.PagedAttentionBackend(HQ, H, D, N, cache_dtype, layout)
  spec = backend.spec
  cache = backend.allocate_kv_cache(B, device=device, num_layers=LAYERS)
  poison(rng, cache, spec)
  ptr = cache.data_ptr()
  scales = (torch.tensor([0.5], device=device), 2.0) if spec.format.has_tensor_scales else (
      None, None)
  js = (jnp.float32(0.5), jnp.float32(2.0)) if spec.format.has_tensor_scales else (None, None)
  used = np.concatenate([np.arange(b * N, (b + 1) * N) for bl in SEQ_BLOCKS for b in bl])
  md = _metadata(device)
  t = sum(Q_LENS) + 1
  compiled = None
  for layer in rng.permutation(LAYERS):
    layer = int(layer)
    before = [_layer_bytes(cache, spec, i) for i in range(LAYERS)]
    slots = np.insert(rng.permutation(used), 7, -1)
    key, value = (rand_bf16(rng, (slots.size + 2, H, D), device) for _ in range(2))
    backend.do_kv_cache_update(key, value, cache, torch.from_numpy(slots).to(device),
                               k_scale=scales[0], v_scale=scales[1], layer=layer)
    assert cache.data_ptr() == ptr
    want = kvjax.reference.write_kv(on_cpu(before[layer]), to_jnp(key), to_jnp(value),
                                    on_cpu(slots.astype(np.int32)), spec, *js)
    for i in range(LAYERS):
      got = _layer_bytes(cache, spec, i)
      np.testing.assert_array_equal(got.view(np.uint8),
                                    np.asarray(want if i == layer else before[i]).view(np.uint8))
    q = rand_bf16(rng, (t, HQ, D), device)
    out = torch.full((t, HQ, D), 7.0, dtype=torch.bfloat16, device=device)
    backend.forward(q, cache, md, out, k_scale=scales[0], v_scale=scales[1], layer=layer)
    meta = {n: on_cpu(getattr(md, n).cpu().numpy())
            for n in ("query_start_loc", "seq_lens", "block_table")}
    ref = kvjax.reference.unified_attention(to_jnp(q), on_cpu(_layer_bytes(cache, spec, layer)),
                                            spec, scale=D ** -0.5, k_scale=js[0], v_scale=js[1],
                                            **meta)
    ref = np.asarray(ref.astype(jnp.float32))
    sync(device)
    assert np.abs(ref[:-1]).max() > 0.05
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=2e-2, atol=2e-2)
    # the jitted functions are shared by backends of one config: count what this test adds,
    # and the kernels launched from torch (CUDA, Hopper: the write; attention here has
    # 4-token queries, which go through JAX)
    write = backend._launches._write.get(cache.device)      # a TorchWrite, a reason or None
    launched = [len(write._compiled)] if hasattr(write, "_compiled") else []
    sizes = [f._cache_size() for f in (*backend._write.values(), *backend._attn.values())]
    assert compiled is None or sizes + launched == compiled, "a new layer compiled a program"
    compiled = sizes + launched
  assert len(compiled) == 2     # one write and one attention program served every layer


def test_facade_refuses_the_wrong_slices_and_layer_arguments(rng):
  backend = tb.PagedAttentionBackend(HQ, H, D, N)
  spec = backend.spec
  kv = backend.allocate_kv_cache(B, num_layers=LAYERS)          # logical (L, B, H, N, C)
  key = rand_bf16(rng, (2, H, D))
  slots = torch.tensor([3, 20], dtype=torch.int32)
  update = lambda cache, **kw: backend.do_kv_cache_update(key, key, cache, slots, **kw)
  with pytest.raises(ValueError, match=r"non-compact view.*like layer 1 of a layered "
                                       r"\(cross-layer\) cache of 3 layers.*layer="):
    update(kv[1])
  with pytest.raises(ValueError, match=r"covers .* of its storage.*one block of a layered "
                                       r"\(cross-layer\) cache.*layer="):
    update(kv[:, 1])                 # block 1 of every layer: shaped like a 3-block cache
  with pytest.raises(ValueError, match=r"covers .* of its storage"):
    update(L.physical_tensor(kv, spec)[2])                     # the same, physically
  with pytest.raises(ValueError, match=r"layered \(cross-layer\) cache of 3 layers: pass the "
                                       r"layer index, layer="):
    update(kv)
  with pytest.raises(ValueError, match=r"layer=3 is outside \[0, 3\)"):
    update(kv, layer=3)
  with pytest.raises(ValueError, match=r"layer=-1 is outside"):
    update(kv, layer=-1)
  with pytest.raises(TypeError, match="layer must be a Python int"):
    update(kv, layer=True)
  with pytest.raises(TypeError, match="layer must be a Python int"):
    update(kv, layer=torch.tensor(1))
  update(kv, layer=2)                                          # fine, and now cached:
  with pytest.raises(ValueError, match=r"layer=5 is outside"):
    update(kv, layer=5)                                        # still checked on a hit
  with pytest.raises(ValueError, match="layer=0 was given, but kv_cache of shape"):
    update(backend.allocate_kv_cache(B), layer=0)
  q = rand_bf16(rng, (3, HQ, D))
  with pytest.raises(ValueError, match="pass the layer index"):
    backend.forward(q, kv, _metadata("cpu"), torch.empty_like(q))
  nvfp4 = tb.PagedAttentionBackend(HQ, H, D, N, "nvfp4", "HND")
  with pytest.raises(ValueError, match="no layered"):
    nvfp4.do_kv_cache_update(key, key, nvfp4.allocate_kv_cache(B, num_layers=2), slots, layer=0)


class _Layer:
  def __init__(self, name):
    self.layer_name = name
    self._k_scale = self._v_scale = torch.tensor(1.0)


@pytest.mark.parametrize("backend_layout", ["NHD", "HND"])
def test_vllm_adapter_takes_a_layered_cache_and_the_layer_from_its_name(rng, backend_layout):
  """vLLM's cross-layer allocation (its stride order with the layers dim), each layer's impl
  call handed the whole tensor: the layer index comes from ``layer.layer_name`` (or
  ``layer_index=``); writes land in that layer only, attention reads that layer."""
  cls = va.KVJaxAttentionBackend if backend_layout == "NHD" else type(
      "HNDBackend", (va.KVJaxAttentionBackend,), {"kv_cache_layout": "HND"})
  spec = kvjax.KVCacheSpec(H, D, N, "auto", backend_layout)
  shape = (LAYERS,) + cls.get_kv_cache_shape(B, N, H, D, "auto")
  order = cls.get_kv_cache_stride_order(include_num_layers_dimension=True)
  phys = torch.zeros([shape[i] for i in order], dtype=torch.bfloat16)
  kv = phys.permute(*[order.index(i) for i in range(5)])       # vLLM's logical view
  poison(rng, kv, spec)
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H)
  used = np.concatenate([np.arange(b * N, (b + 1) * N) for bl in SEQ_BLOCKS for b in bl])
  slots = torch.from_numpy(rng.permutation(used).astype(np.int64))    # vLLM's int64 slots
  key, value = rand_bf16(rng, (used.size, H, D)), rand_bf16(rng, (used.size, H, D))
  before = [_layer_bytes(kv, spec, i) for i in range(LAYERS)]
  impl.do_kv_cache_update(_Layer("model.layers.2.self_attn.attn"), key, value, kv, slots)
  want = kvjax.reference.write_kv(jnp.asarray(before[2]), to_jnp(key), to_jnp(value),
                                  jnp.asarray(slots.numpy().astype(np.int32)), spec)
  np.testing.assert_array_equal(_layer_bytes(kv, spec, 2).view(np.uint8),
                                np.asarray(want).view(np.uint8))
  for i in (0, 1):
    np.testing.assert_array_equal(_layer_bytes(kv, spec, i).view(np.uint8),
                                  before[i].view(np.uint8))
  md = va.KVJaxAttentionMetadata(
      *(_metadata("cpu").__getattribute__(n) for n in ("query_start_loc", "seq_lens",
                                                      "block_table", "slot_mapping")),
      max_query_len=max(Q_LENS), max_seq_len=max(SEQ_LENS), num_actual_tokens=sum(Q_LENS))
  q = rand_bf16(rng, (sum(Q_LENS), HQ, D))
  outs = []
  for kw in ({"layer_index": 2}, {}):
    out = torch.zeros_like(q)
    impl.forward(_Layer("decoder.2.attn" if kw else "model.layers.2.self_attn.attn"), q,
                 key, value, kv, md, output=out, **kw)
    outs.append(out)
  meta = {n: jnp.asarray(getattr(md, n).numpy())
          for n in ("query_start_loc", "seq_lens", "block_table")}
  ref = np.asarray(kvjax.reference.unified_attention(
      to_jnp(q), jnp.asarray(_layer_bytes(kv, spec, 2)), spec, scale=D ** -0.5,
      **meta).astype(jnp.float32))
  assert np.abs(ref).max() > 0.05
  for out in outs:
    np.testing.assert_allclose(out.float().numpy(), ref, rtol=2e-2, atol=2e-2)
  with pytest.raises(ValueError, match="pass layer_index=, or a layer whose layer_name"):
    impl.forward(_Layer("encoder.attn"), q, key, value, kv, md, output=torch.zeros_like(q))
  with pytest.raises(ValueError, match="non-compact view.*layer="):
    impl.forward(_Layer("model.layers.1.attn"), q, key, value, kv[1], md,
                 output=torch.zeros_like(q))
