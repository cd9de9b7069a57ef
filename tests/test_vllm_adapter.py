"""torch_bridge.vllm_adapter on CPU, driven the way vLLM drives an attention backend.

The cache is allocated the way vLLM allocates it (a zeroed physical buffer permuted by the
backend's stride order), the layer is a stand-in carrying vLLM's per-tensor scale attributes,
metadata comes from the builder fed a stand-in for vLLM's CommonAttentionMetadata, and
results are checked against kvjax's reference on the very same bytes.
"""
import dataclasses
import enum
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from kv_testing import assert_written_as_reference, poisoned_cache
from torch_bridge import dtypes
from torch_bridge import layout as L
from torch_bridge import vllm_adapter as va

H, HQ, D, N, B = 2, 4, 32, 16, 12
# (cached tokens before the step, new tokens in the step): a chunked prefill, a decode,
# a fresh prefill, a decode
SEQS = [(20, 13), (33, 1), (0, 7), (47, 1)]
PAD = 3            # padded token rows after the real ones (vLLM pads to a CUDA-graph size)


class FakeLayer:
  """vLLM's Attention layer as the impl sees it: per-tensor scales, tensors and host floats."""

  def __init__(self, k_scale=1.0, v_scale=1.0):
    self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
    self._v_scale = torch.tensor(v_scale, dtype=torch.float32)
    self._q_scale = torch.tensor(1.0, dtype=torch.float32)
    self._k_scale_float, self._v_scale_float, self._q_scale_float = k_scale, v_scale, 1.0


class HNDBackend(va.KVJaxAttentionBackend):
  kv_cache_layout = "HND"


def _spec(cache_dtype, layout):
  return kvjax.KVCacheSpec(H, D, N, cache_dtype, layout, jnp.bfloat16)


def _vllm_allocate(backend_cls, spec, rng):
  """vLLM's allocation: a physical buffer in stride order, handed on as the logical view.

  The buffer is filled with random (finite) bytes so that untouched bytes are recognizable.
  """
  shape = backend_cls.get_kv_cache_shape(B, N, H, D, spec.cache_dtype)
  order = backend_cls.get_kv_cache_stride_order()
  phys = torch.zeros([shape[i] for i in order], dtype=dtypes.cache_torch_dtype(spec))
  phys.view(torch.uint8).reshape(-1).copy_(
      torch.from_numpy(np.array(poisoned_cache(rng, spec, B)).reshape(-1).view(np.uint8)))
  return phys.permute(*[order.index(i) for i in range(len(order))])


def _cache_bytes(kv_cache, spec):
  return L.physical_tensor(kv_cache, spec).contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _jax_cache(byte_array, spec):
  return jnp.asarray(byte_array.view(spec.storage_dtype).reshape(spec.physical_shape(B)))


def _bf16(rng, shape, scale=1.0):
  return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).bfloat16()


def _jnp(t):
  return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)


def _scales(spec, rng):
  """Random per-tensor scales for formats that use them, else vLLM's default 1.0."""
  if spec.format.has_tensor_scales:
    return float(np.float32(rng.uniform(0.02, 0.2))), float(np.float32(rng.uniform(0.05, 0.5)))
  return 1.0, 1.0


def _ref_write(before, key, value, slots, spec, layer):
  """The reference's bytes, computed on the CPU device: XLA-GPU's compile of the per-token-head
  quantizers may round a code differently (benchmarks/RESULTS.md, "Writes"), and the kernels
  are held to the CPU reference."""
  ks = vs = None
  if spec.format.has_tensor_scales:
    ks, vs = jnp.float32(layer._k_scale_float), jnp.float32(layer._v_scale_float)
  cpu = jax.devices("cpu")[0]
  args = [jax.device_put(x, cpu) for x in (_jax_cache(before, spec), _jnp(key), _jnp(value),
                                           jnp.asarray(slots.numpy()))]
  with jax.default_device(cpu):
    out = jax.jit(lambda c, k, v, s: kvjax.reference.write_kv(c, k, v, s, spec, ks, vs))(*args)
  return np.asarray(out).reshape(-1).view(np.uint8)


def _schedule(rng):
  """Block tables (a shuffled pool), history slots and the step's slots, per SEQS."""
  pool = list(rng.permutation(B))
  tables, history, step = [], [], []
  for cached, new in SEQS:
    blocks = [pool.pop() for _ in range(-(-(cached + new) // N))]
    tables.append(blocks)
    slot = lambda p, b=blocks: b[p // N] * N + p % N
    history += [slot(p) for p in range(cached)]
    step += [slot(p) for p in range(cached, cached + new)]
  width = max(len(t) for t in tables)
  table = np.array([t + [t[0]] * (width - len(t)) for t in tables], np.int32)
  return table, np.array(history, np.int64), np.array(step, np.int64)


def _common_metadata(table, step_slots, seqs=SEQS):
  """A stand-in for vLLM's CommonAttentionMetadata of the step (slot mapping padded by -1)."""
  qsl = np.concatenate([[0], np.cumsum([new for _, new in seqs])]).astype(np.int32)
  seq_lens = np.array([c + n for c, n in seqs], np.int32)
  slots = np.concatenate([step_slots, -np.ones(PAD, np.int64)])
  return types.SimpleNamespace(
      query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=torch.from_numpy(qsl),
      seq_lens=torch.from_numpy(seq_lens), num_reqs=len(seqs), num_actual_tokens=int(qsl[-1]),
      max_query_len=max(n for _, n in seqs), max_seq_len=int(seq_lens.max()),
      block_table_tensor=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots),
      causal=True)


def _bound(ref):
  """Two bf16 roundings apart at most: 2^-7 of each (token, head) row's largest magnitude."""
  return 2.0 ** -7 * np.abs(ref).max(-1, keepdims=True) + 1e-6


# -- the static API ---------------------------------------------------------------------------
def test_static_methods_answer_as_kvjax():
  be = va.KVJaxAttentionBackend
  for cd in kvjax.CACHE_FORMATS:
    assert be.get_kv_cache_shape(7, 32, 4, 64, cd) == kvjax.get_kv_cache_shape(7, 32, 4, 64, cd)
    assert be.get_kv_cache_shape(7, 32, 4, 64, cache_dtype_str=cd) == \
        be.get_kv_cache_shape(7, 32, 4, 64, cd)
    assert be.supports_kv_cache_dtype(cd)
  assert be.get_kv_cache_shape(3, 16, 2, 8) == (3, 2, 16, 16)
  assert be.supported_kv_cache_dtypes == list(kvjax.CACHE_FORMATS)
  assert not be.supports_kv_cache_dtype("fp4_bogus")
  for backend_cls, layout in ((be, "NHD"), (HNDBackend, "HND")):
    for layers in (False, True):
      assert backend_cls.get_kv_cache_stride_order(include_num_layers_dimension=layers) == \
          kvjax.get_kv_cache_stride_order(layout, layers)
    assert backend_cls.get_required_kv_cache_layout() == layout
  assert be.get_kv_cache_stride_order() == (0, 2, 1, 3)

  (entry,) = be.get_supported_kernel_block_sizes()
  assert isinstance(entry, va.MultipleOf)
  for n in (1, 8, 16, 20, 32, 48, 64, 100, 256, 0, -16):
    kvjax_takes = _kvjax_accepts_block_size(n)
    assert be.supports_block_size(n) == kvjax_takes == (n > 0 and n % entry.base == 0), n
  assert be.supports_block_size(None)
  assert be.get_supported_head_sizes() == []
  assert be.supports_head_size(64) and be.supports_head_size(80) and be.supports_head_size(3)
  assert not be.supports_head_size(0)
  assert be.supports_dtype(torch.bfloat16) and not be.supports_dtype(torch.int8)
  assert be.supports_attn_type("decoder") and not be.supports_attn_type("encoder")
  assert be.supports_sink()
  assert be.get_name() == "KVJAX"
  assert be.get_impl_cls() is va.KVJaxAttentionImpl
  assert be.get_builder_cls() is va.KVJaxAttentionMetadataBuilder
  assert be.accept_output_buffer and not be.forward_includes_kv_cache_update
  impl = be.get_impl_cls()(HQ, D, 0.125, H, None, None, "fp8", None, "decoder", None)
  assert (impl.num_heads, impl.head_size, impl.num_kv_heads, impl.scale) == (HQ, D, H, 0.125)
  assert not impl.supports_quant_query_input and not impl.fused_output_quant_supported(None)
  assert impl.process_weights_after_loading(torch.bfloat16) is None
  with pytest.raises(ValueError, match="block_size"):
    be.get_kv_cache_shape(4, 24, 2, 64)
  with pytest.raises(ValueError, match="head_size"):
    be.get_kv_cache_shape(4, 16, 2, 66, "int4_per_token_head")


def _kvjax_accepts_block_size(n):
  try:
    kvjax.get_kv_cache_shape(1, n, 1, 64)
    return True
  except ValueError:
    return False


def test_block_size_entry_is_vllms_class_when_vllm_is_loaded(monkeypatch):
  class VllmMultipleOf:
    def __init__(self, base):
      self.base = base
  fake = types.ModuleType("vllm.v1.attention.backend")
  fake.MultipleOf = VllmMultipleOf
  monkeypatch.setitem(sys.modules, "vllm.v1.attention.backend", fake)
  (entry,) = va.KVJaxAttentionBackend.get_supported_kernel_block_sizes()
  assert type(entry) is VllmMultipleOf and entry.base == 16


# -- the calls --------------------------------------------------------------------------------
def test_profiling_run_leaves_output_and_cache_untouched(rng):
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
  spec = _spec("auto", "NHD")
  kv_cache = _vllm_allocate(va.KVJaxAttentionBackend, spec, rng)
  cache_before = _cache_bytes(kv_cache, spec)
  q = _bf16(rng, (9, HQ, D))
  out = _bf16(rng, (9, HQ * D), 5.0)
  out_before = out.clone()
  assert impl.forward(FakeLayer(), q, q[:, :H], q[:, :H], kv_cache, None, output=out) is out
  assert torch.equal(out.view(torch.int16), out_before.view(torch.int16))
  np.testing.assert_array_equal(_cache_bytes(kv_cache, spec), cache_before)
  # before the caches exist vLLM hands each layer an empty placeholder
  assert impl.do_kv_cache_update(FakeLayer(), q[:, :H], q[:, :H], torch.tensor([]),
                                 torch.arange(9)) is None


CASES = [
    ("auto", "NHD", dict()),
    ("fp8", "NHD", dict(logits_soft_cap=0.0)),     # 0 = vLLM's "no soft cap"
    ("int8_per_token_head", "HND", dict(sliding_window=9, logits_soft_cap=5.0, sinks=True)),
]


@pytest.mark.parametrize("cache_dtype,layout,opts", CASES)
def test_ragged_step_matches_reference_and_padding_rows_untouched(rng, cache_dtype, layout, opts):
  backend_cls = HNDBackend if layout == "HND" else va.KVJaxAttentionBackend
  spec = _spec(cache_dtype, layout)
  opts = dict(opts)
  sinks = None
  if opts.pop("sinks", False):
    sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
  scale = float(rng.uniform(0.1, 0.3))
  impl = backend_cls.get_impl_cls()(HQ, D, scale, H, None, opts.get("sliding_window"),
                                    cache_dtype, opts.get("logits_soft_cap"), "decoder",
                                    sinks=sinks)
  layer = FakeLayer(*_scales(spec, rng))
  kv_cache = _vllm_allocate(backend_cls, spec, rng)
  table, history, step_slots = _schedule(rng)

  # the history (earlier steps), then this step's new tokens, as vLLM's update op would
  hk, hv = _bf16(rng, (history.size, H, D)), _bf16(rng, (history.size, H, D), 2.0)
  impl.do_kv_cache_update(layer, hk, hv, kv_cache, torch.from_numpy(history))
  common = _common_metadata(table, step_slots)
  md = backend_cls.get_builder_cls()(None, ["layer.0"], None, "cpu").build(0, common)
  t = md.num_actual_tokens + PAD
  key, value = _bf16(rng, (t, H, D)), _bf16(rng, (t, H, D), 2.0)
  before = _cache_bytes(kv_cache, spec)
  impl.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
  as_cache = lambda raw: raw.view(spec.storage_dtype).reshape(spec.physical_shape(B))
  assert_written_as_reference(
      as_cache(_cache_bytes(kv_cache, spec)),
      as_cache(_ref_write(before, key[:step_slots.size], value[:step_slots.size],
                          torch.from_numpy(step_slots), spec, layer)),
      spec, step_slots)

  q = _bf16(rng, (t, HQ, D))
  out = _bf16(rng, (t, HQ * D), 5.0)          # vLLM's output buffer: [T, Hq*D], poisoned
  out_before = out.clone()
  assert impl.forward(layer, q, key, value, kv_cache, md, output=out) is out

  n = md.num_actual_tokens
  assert torch.equal(out[n:].view(torch.int16), out_before[n:].view(torch.int16))
  ks = vs = None
  if spec.format.has_tensor_scales:
    ks, vs = jnp.float32(layer._k_scale_float), jnp.float32(layer._v_scale_float)
  attend = jax.jit(lambda q, cache, qsl, seq_lens, table: kvjax.reference.unified_attention(
      q, cache, spec, query_start_loc=qsl, seq_lens=seq_lens, block_table=table, scale=scale,
      sliding_window=opts.get("sliding_window"), soft_cap=opts.get("logits_soft_cap") or None,
      sinks=None if sinks is None else jnp.asarray(sinks.numpy()), k_scale=ks, v_scale=vs))
  ref = attend(_jnp(q[:n]), tb.from_torch(kv_cache, spec), *(
      jnp.asarray(x.numpy()) for x in (md.query_start_loc, md.seq_lens, md.block_table)))
  ref = np.asarray(ref.astype(jnp.float32))
  got = out[:n].view(n, HQ, D).float().numpy()
  assert np.abs(ref).max() > 0.05
  assert (np.abs(got - ref) <= _bound(ref)).all(), np.abs(got - ref).max()


def test_fp8_scales_are_read_from_the_layer_at_each_call(rng):
  spec = _spec("fp8", "NHD")
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H, None, None, "fp8")
  layer = FakeLayer(*_scales(spec, rng))
  kv_cache = _vllm_allocate(va.KVJaxAttentionBackend, spec, rng)
  for _ in range(2):
    slots = torch.from_numpy(rng.choice(B * N, 10, replace=False))
    key, value = _bf16(rng, (10, H, D), 3.0), _bf16(rng, (10, H, D))
    before = _cache_bytes(kv_cache, spec)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    np.testing.assert_array_equal(_cache_bytes(kv_cache, spec),
                                  _ref_write(before, key, value, slots, spec, layer))
    # vLLM may recompute the scales in place (calculate_kv_scales): the next call sees them
    k_new, v_new = _scales(spec, rng)
    layer._k_scale.fill_(k_new)
    layer._v_scale.fill_(v_new)
    layer._k_scale_float, layer._v_scale_float = k_new, v_new


def test_do_kv_cache_update_writes_only_named_slots(rng):
  spec = _spec("int8_per_token_head", "HND")
  impl = HNDBackend.get_impl_cls()(HQ, D, 1.0, H, None, None, "int8_per_token_head")
  kv_cache = _vllm_allocate(HNDBackend, spec, rng)
  before = _cache_bytes(kv_cache, spec)
  ptr = kv_cache.data_ptr()
  slots = rng.choice(B * N, 12, replace=False)
  slots[[3, 7]] = -1                                    # skipped tokens
  key, value = _bf16(rng, (12 + PAD, H, D)), _bf16(rng, (12 + PAD, H, D))   # padded rows
  impl.do_kv_cache_update(FakeLayer(), key, value, kv_cache, torch.from_numpy(slots))
  after = _cache_bytes(kv_cache, spec)
  assert kv_cache.data_ptr() == ptr
  np.testing.assert_array_equal(after, _ref_write(before, key[:12], value[:12],
                                                  torch.from_numpy(slots), spec, FakeLayer()))
  # explicitly: every (block, head, token) row not named keeps its bytes
  rows_after = after.reshape(B, H, N, -1)
  rows_before = before.reshape(B, H, N, -1)
  named = np.zeros((B, N), bool)
  named[slots[slots >= 0] // N, slots[slots >= 0] % N] = True
  np.testing.assert_array_equal(rows_after.transpose(0, 2, 1, 3)[~named],
                                rows_before.transpose(0, 2, 1, 3)[~named])
  assert (rows_after.transpose(0, 2, 1, 3)[named] != rows_before.transpose(0, 2, 1, 3)[named]).any()


def test_zero_actual_tokens_writes_nothing(rng):
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
  kv_cache = _vllm_allocate(va.KVJaxAttentionBackend, _spec("auto", "NHD"), rng)
  table, _, step_slots = _schedule(rng)
  md = va.KVJaxAttentionMetadataBuilder(None, [], None, "cpu").build(
      0, _common_metadata(table, step_slots))
  q, out = _bf16(rng, (4, HQ, D)), _bf16(rng, (4, HQ, D))
  out_before = out.clone()
  impl.forward(FakeLayer(), q, None, None, kv_cache, dataclasses.replace(md, num_actual_tokens=0),
               output=out)
  assert torch.equal(out.view(torch.int16), out_before.view(torch.int16))


def test_padded_steps_compile_per_padded_size_not_per_actual_count(rng):
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
  kv_cache = _vllm_allocate(va.KVJaxAttentionBackend, _spec("auto", "NHD"), rng)
  table, _, step_slots = _schedule(rng)
  build = va.KVJaxAttentionMetadataBuilder(None, [], None, "cpu").build
  t = sum(n for _, n in SEQS) + PAD           # one padded size (a CUDA-graph size in vLLM)
  q = _bf16(rng, (t, HQ, D))
  compiles = []

  def listener(event, duration_secs, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    counts = []
    for seqs in (SEQS, [(20, 12), (33, 1), (0, 5), (47, 1)], [(21, 11), (34, 1), (1, 6), (46, 1)]):
      md = build(0, _common_metadata(table, step_slots, seqs))
      out = _bf16(rng, (t, HQ, D))
      out_before = out.clone()
      impl.forward(FakeLayer(), q, None, None, kv_cache, md, output=out)
      n = md.num_actual_tokens
      assert torch.equal(out[n:].view(torch.int16), out_before[n:].view(torch.int16))
      counts.append(len(compiles))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert counts[0] >= 1                       # the listener sees compilations at all
  assert counts[2] == counts[0], counts       # 22, 19 and 19 real tokens: one program


# -- refusals ---------------------------------------------------------------------------------
def test_unsupported_arguments_are_refused_by_name(rng):
  make = va.KVJaxAttentionImpl
  with pytest.raises(NotImplementedError, match="alibi_slopes"):
    make(HQ, D, 1.0, H, [0.5] * HQ, None, "auto")
  with pytest.raises(NotImplementedError, match="alibi"):
    make(HQ, D, 1.0, H, None, None, "auto", use_alibi_sqrt=True)
  attention_type = enum.Enum("AttentionType", {"DECODER": "decoder", "ENCODER": "encoder"},
                             type=str)             # vLLM's str enum
  assert make(HQ, D, 1.0, H, None, None, "auto", attn_type=attention_type.DECODER).attn_type
  with pytest.raises(NotImplementedError, match="attn_type='encoder'"):
    make(HQ, D, 1.0, H, None, None, "auto", attn_type=attention_type.ENCODER)
  with pytest.raises(NotImplementedError, match="attn_type='encoder_only'"):
    make(HQ, D, 1.0, H, None, None, "auto", attn_type="encoder_only")
  with pytest.raises(ValueError, match="cache_dtype='fp4_bogus'"):
    make(HQ, D, 1.0, H, None, None, "fp4_bogus")
  with pytest.raises(ValueError, match="num_heads=3"):
    make(3, D, 1.0, H, None, None, "auto")
  with pytest.raises(ValueError, match="head_size=66"):
    make(HQ, 66, 1.0, H, None, None, "int4_per_token_head")
  with pytest.raises(TypeError, match="use_cuda_graph"):
    make(HQ, D, 1.0, H, None, None, "auto", use_cuda_graph=True)

  impl = make(HQ, D, 1.0, H, None, None, "auto")
  kv_cache = _vllm_allocate(va.KVJaxAttentionBackend, _spec("auto", "NHD"), rng)
  table, _, step_slots = _schedule(rng)
  md = va.KVJaxAttentionMetadataBuilder(None, [], None, "cpu").build(
      0, _common_metadata(table, step_slots))
  t = md.num_actual_tokens
  q, out = _bf16(rng, (t, HQ, D)), torch.zeros(t, HQ, D, dtype=torch.bfloat16)
  layer = FakeLayer()
  with pytest.raises(NotImplementedError, match="output_scale"):
    impl.forward(layer, q, None, None, kv_cache, md, out, output_scale=torch.ones(1))
  with pytest.raises(NotImplementedError, match="output_block_scale"):
    impl.forward(layer, q, None, None, kv_cache, md, out, output_block_scale=torch.ones(1))
  with pytest.raises(ValueError, match="output must be a preallocated"):
    impl.forward(layer, q, None, None, kv_cache, md)
  with pytest.raises(TypeError, match="attn_metadata must be a KVJaxAttentionMetadata"):
    impl.forward(layer, q, None, None, kv_cache, _common_metadata(table, step_slots), out)
  with pytest.raises(ValueError, match=f"num_actual_tokens={t} exceeds"):
    impl.forward(layer, q[:t - 1], None, None, kv_cache, md, out[:t - 1])
  with pytest.raises(TypeError, match="has no _k_scale"):
    impl.forward(object(), q, None, None, kv_cache, md, out)
  with pytest.raises(ValueError, match="kv_cache must be one layer's 4-D .* or a layered 5-D"):
    impl.forward(layer, q, None, None, kv_cache[None, None], md, out)
  with pytest.raises(ValueError, match="layered .* pass layer_index="):   # a stack of 1 layer
    impl.forward(layer, q, None, None, kv_cache[None], md, out)
  with pytest.raises(ValueError, match="num_actual_tokens must be a non-negative int"):
    va.KVJaxAttentionMetadata(md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping,
                              md.max_query_len, md.max_seq_len, num_actual_tokens=-1)
  per_request = _common_metadata(table, step_slots)
  per_request.causal = torch.ones(len(SEQS), dtype=torch.bool)
  with pytest.raises(NotImplementedError, match="causal must be a bool"):
    va.KVJaxAttentionMetadataBuilder(None, [], None, "cpu").build(0, per_request)
