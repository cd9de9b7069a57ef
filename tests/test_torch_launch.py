"""Kernels launched from torch on torch's stream (torch_bridge.mosaic_launch / mosaic_decode).

CPU: the kernel module a launch compiles is taken from the kernel's CUDA lowering (and a
function doing more than call the kernel is refused); the facade says which path a call
takes and why. CUDA (Hopper, jax >= 0.11): the decode launch equals kvjax's reference on
poisoned caches and outputs for plain, fp8 and int8 / fp8 per-token-head caches, both
layouts, GQA 1 to 16, window, soft cap, sinks, split merges; a multi-layer decode step
captured in a CUDA graph replays correctly after its inputs' contents change, with no host
synchronization.
"""
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from pallas_kernels.mosaic_gpu import decode as MD
from pallas_kernels.mosaic_gpu import decode_kernel as DK
from torch_bridge import dtypes as torch_dtypes
from torch_bridge import layout as L
from torch_bridge import mosaic_decode as MDT
from torch_bridge import mosaic_launch as ML
from torch_bridge import mosaic_write as MW
from torch_testing import cache_array, on_cpu, poison, rand_bf16, to_jnp

BF16 = jnp.bfloat16


def _launch_reason():
  if not torch.cuda.is_available():
    return "no CUDA device"
  return MDT.platform_reason("cuda")


requires_launch = pytest.mark.skipif(_launch_reason() is not None,
                                     reason=f"torch launch: {_launch_reason()}")


# -- CPU: the kernel module, the path the facade takes ----------------------------------------
def _decode_structs(spec, rows=3, seqs=3, width=4, blocks=16, finish=True):
  st = MD.decode_statics(spec, BF16, rows, 4 * spec.num_kv_heads, seqs, width, blocks,
                         finish=finish, num_sms=132)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)      # noqa: E731
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)    # noqa: E731
  q = jax.ShapeDtypeStruct((rows, 16, spec.head_size), st.ops.compute)
  cache = jax.ShapeDtypeStruct(MD.cache_view_shape(spec.physical_shape(blocks), st),
                               spec.storage_dtype)
  h = spec.num_kv_heads
  return st, [i32(seqs + 1), i32(seqs), i32(seqs * width), f32(h), f32(h), q, cache]


def test_kernel_module_is_the_one_kernel_call():
  spec = kvjax.KVCacheSpec(4, 64, 16, "bfloat16", dtype=BF16)
  st, structs = _decode_structs(spec)

  def fn(qsl, sl, bt, fac, vfac, q, cache):
    return DK.decode_call(qsl, sl, bt, fac, q, cache, st=st, v_factors=vfac, out_dtype=BF16)
  module = ML.kernel_module(fn, *structs)
  assert len(module.asm) > 1000
  assert module.inputs == tuple((tuple(s.shape), np.dtype(s.dtype)) for s in structs)
  assert module.outputs == (((3, 16, 64), np.dtype(BF16)),)

  def more(qsl, sl, bt, fac, vfac, q, cache):     # an XLA op before the kernel
    return fn(qsl + 0, sl, bt, fac, vfac, q, cache)
  with pytest.raises(ValueError, match="exactly one Mosaic GPU kernel and nothing else"):
    ML.kernel_module(more, *structs)

  def swapped(qsl, sl, bt, fac, vfac, q, cache):  # the kernel's inputs in another order
    return DK.decode_call(qsl, sl, bt, vfac, q, cache, st=st, v_factors=fac, out_dtype=BF16)
  with pytest.raises(ValueError, match="unchanged and in order"):
    ML.kernel_module(swapped, *structs)


@pytest.mark.parametrize("cache_dtype,layout", [("int8_per_token_head", "NHD"),
                                                ("fp8_per_token_head", "HND")])
def test_kernel_module_of_a_per_token_head_cache_takes_its_row_view(cache_dtype, layout):
  """A per-token-head cache is launched as a view whose rows are 16 bytes apart (two tokens a
  row here: a token's rows are 8 bytes off 16), the same bytes as the physical tensor."""
  spec = kvjax.KVCacheSpec(1, 128, 16, cache_dtype, layout=layout, dtype=BF16)
  st, structs = _decode_structs(spec)
  physical = spec.physical_shape(16)
  assert structs[-1].shape != physical and np.prod(structs[-1].shape) == np.prod(physical)
  assert structs[-1].shape[-1] * spec.itemsize % 16 == 0

  def fn(qsl, sl, bt, fac, vfac, q, cache):
    return DK.decode_call(qsl, sl, bt, fac, q, cache, st=st, v_factors=vfac, out_dtype=BF16)
  module = ML.kernel_module(fn, *structs)
  assert module.inputs[-1] == (tuple(structs[-1].shape), np.dtype(spec.storage_dtype))
  assert module.inputs[-2] == ((3, 16, 128), np.dtype(st.ops.compute))


@pytest.mark.skipif(MDT.JAX_VERSION < (0, 11), reason="a Ref argument of a Mosaic GPU kernel "
                    "lowers on jax >= 0.11")
def test_write_module_updates_the_cache_in_place():
  """The row-store kernel takes the cache as a ref: its one output is the cache itself (an
  aliased input), so a launch writes the tensor it is given."""
  from pallas_kernels.mosaic_gpu.write import write_rows
  spec = kvjax.KVCacheSpec(2, 64, 16, "bfloat16", dtype=BF16)
  rows = jax.ShapeDtypeStruct((5, 2, 64), BF16)
  cache = jax.ShapeDtypeStruct(spec.physical_shape(8), BF16)
  module = ML.kernel_module(lambda s, k, v, c: write_rows(c, k, v, s, spec),
                            jax.ShapeDtypeStruct((5,), jnp.int32), rows, rows, cache)
  assert module.outputs == ((cache.shape, np.dtype(BF16)),)
  assert MW.spec_reason(spec) is None
  assert MW.spec_reason(kvjax.KVCacheSpec(2, 64, 16, "fp8", dtype=BF16)) is None
  assert "not a multiple of 128" in MW.spec_reason(kvjax.KVCacheSpec(3, 64, 16, "fp8",
                                                                    dtype=BF16))
  assert "per-tensor" in MW.spec_reason(kvjax.KVCacheSpec(2, 64, 16, "int8_per_token_head",
                                                          dtype=BF16))


def test_spec_reason_names_what_the_kernel_cannot_read():
  assert MDT.spec_reason(kvjax.KVCacheSpec(8, 128, 16, "bfloat16", dtype=BF16),
                         torch.bfloat16, 32) is None
  assert MDT.spec_reason(kvjax.KVCacheSpec(8, 128, 16, "fp8", dtype=BF16),
                         torch.bfloat16, 32) is None
  for name in ("int8_per_token_head", "fp8_per_token_head"):
    spec = kvjax.KVCacheSpec(8, 128, 16, name, dtype=BF16)
    assert MDT.spec_reason(spec, torch.bfloat16, 32) is None
    assert "layered" in MDT.layered_reason(spec)
  assert MDT.layered_reason(kvjax.KVCacheSpec(8, 128, 16, "fp8", dtype=BF16)) is None
  why = MDT.spec_reason(kvjax.KVCacheSpec(8, 128, 16, "int4_per_token_head", dtype=BF16),
                        torch.bfloat16, 32)
  assert why is not None and "Triton kernel" in why
  assert "faster" in MDT.spec_reason(kvjax.KVCacheSpec(8, 128, 16, "nvfp4", "HND"),
                                    torch.bfloat16, 32)
  assert "GQA group 11" in MDT.spec_reason(
      kvjax.KVCacheSpec(8, 128, 16, "bfloat16", dtype=BF16), torch.bfloat16, 88)
  assert "head_size=96" in MDT.spec_reason(
      kvjax.KVCacheSpec(2, 96, 16, "bfloat16", dtype=BF16), torch.bfloat16, 4)
  assert "cpu" in MDT.platform_reason("cpu")


def _decode_metadata(device, seq_lens, width, num_blocks, rng, query_counts=None):
  counts = [1] * len(seq_lens) if query_counts is None else query_counts
  qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  bt = rng.integers(0, num_blocks, (len(seq_lens), width)).astype(np.int32)
  t = lambda x: torch.from_numpy(np.asarray(x, np.int32)).to(device)   # noqa: E731
  return tb.PagedAttentionMetadata(
      query_start_loc=t(qsl), seq_lens=t(seq_lens), block_table=t(bt),
      slot_mapping=t(np.full(len(seq_lens), -1)), max_query_len=max(counts),
      max_seq_len=max(seq_lens))


def test_facade_says_which_path_a_call_takes(rng):
  backend = tb.PagedAttentionBackend(8, 2, 64, 16, "bfloat16")
  cache = backend.allocate_kv_cache(8)
  poison(rng, cache, backend.spec)
  md = _decode_metadata("cpu", [5, 17], 2, 8, rng)
  q = rand_bf16(rng, (2, 8, 64))
  out = torch.empty_like(q)
  backend.forward(q, cache, md, out)
  assert backend.last_path.startswith("jax (xla): tensors on cpu")   # auto's CPU attention
  assert "Triton kernels (through JAX) are faster" in backend.direct_reason(
      "cuda", _decode_metadata("cpu", [5, 17], 2, 8, rng, [2, 1]))
  prefill = _decode_metadata("cpu", [200, 17], 2, 8, rng, [150, 1])
  assert "layered" in backend.direct_reason("cuda", prefill, layered=True)
  backend.do_kv_cache_update(q[:, :2], q[:, 2:4], cache, md.slot_mapping)
  assert backend.last_write_path.startswith("jax (reference): tensors on cpu")
  named = tb.PagedAttentionBackend(8, 2, 64, 16, "bfloat16", impl="pallas")
  named.forward(q, cache, md, out)
  assert named.last_path.startswith("jax (pallas, interpret mode): ")
  off = tb.PagedAttentionBackend(8, 2, 64, 16, "bfloat16", direct_launch=False)
  assert off.direct_reason("cuda", md) == "direct_launch=False"
  ref = tb.PagedAttentionBackend(8, 2, 64, 16, "bfloat16", impl="reference")
  assert ref.direct_reason("cuda", md) == "impl='reference'"


# -- CPU, jax >= 0.11: the launch's operands, the kernel in interpret mode ----------------------
class _InterpretedLaunch:
  """Stands in for :class:`torch_bridge.mosaic_launch.TorchLaunch` on the CPU: checks the
  buffers as a launch does, runs the module's function (the kernel, interpret mode) on the
  inputs' values and writes its results into the output tensors."""

  def __init__(self, module, device):
    self.module, self.fn = module, jax.jit(module.fn)

  def launch(self, *buffers):
    n = len(self.module.inputs)
    for i, (t, (shape, dtype)) in enumerate(zip(buffers, self.module.inputs +
                                                self.module.outputs, strict=True)):
      assert (tuple(t.shape), np.dtype(torch_dtypes.numpy_dtype(t.dtype))) == (shape, dtype), i
      assert t.is_contiguous(), i
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}     # numpy lacks bf16 / fp8
    args = [jnp.asarray(t.view(raw[t.element_size()]).numpy().view(
        torch_dtypes.numpy_dtype(t.dtype))) for t in buffers[:n]]
    results = self.fn(*args)
    for t, r in zip(buffers[n:], results if isinstance(results, tuple) else (results,)):
      t.copy_(torch.from_numpy(np.array(r, np.float32)))


def _interpreted_module(fn, *structs):
  outs = jax.eval_shape(fn, *structs)
  outs = outs if isinstance(outs, tuple) else (outs,)
  return SimpleNamespace(fn=fn, inputs=tuple((tuple(x.shape), np.dtype(x.dtype)) for x in structs),
                         outputs=tuple((tuple(x.shape), np.dtype(x.dtype)) for x in outs))


@pytest.mark.skipif(MDT.JAX_VERSION < (0, 11), reason="Mosaic GPU interpret mode: jax >= 0.11")
@pytest.mark.parametrize("cache_dtype,layout,h,g,d,n,lens,width,opts", [
    ("int8_per_token_head", "NHD", 2, 4, 64, 16, [100, 1, 77], 8, dict(sinks=True)),
    ("fp8_per_token_head", "HND", 2, 2, 64, 16, [40, 129], 12,
     dict(sliding_window=50, soft_cap=20.0)),
    ("fp8_per_token_head", "NHD", 1, 8, 128, 16, [500, 3, 250], 32, dict(splits=True)),
    ("bfloat16", "HND", 2, 4, 64, 16, [100, 1, 77], 8, dict(sinks=True)),
    ("fp8", "NHD", 2, 4, 128, 16, [40, 129], 12, dict(soft_cap=20.0)),
])
def test_launch_operands_equal_reference_in_interpret_mode(monkeypatch, rng, cache_dtype,
                                                           layout, h, g, d, n, lens, width,
                                                           opts):
  """What a torch launch passes the decode kernel (the cache's row view, the float16 query,
  the factors) and what it does with the results (split partials merged in torch), the
  kernel run in Mosaic GPU interpret mode on the same tensors: equal to the reference over a
  poisoned cache; the row of no sequence is 0."""
  opts = dict(opts)
  if opts.pop("splits", False):
    monkeypatch.setattr(MDT, "MIN_STEPS_PER_SPLIT", 4)
  monkeypatch.setattr(ML, "kernel_module", _interpreted_module)
  monkeypatch.setattr(ML, "TorchLaunch", _InterpretedLaunch)
  monkeypatch.setattr(MD, "decode_statics", functools.partial(MD.decode_statics, interpret=True))
  monkeypatch.setattr(torch.cuda, "get_device_properties",
                      lambda device: SimpleNamespace(multi_processor_count=132))
  sinks = rng.standard_normal(h * g).astype(np.float32) if opts.pop("sinks", False) else None
  backend = tb.PagedAttentionBackend(h * g, h, d, n, cache_dtype, layout, dtype=torch.bfloat16,
                                     sinks=sinks, **opts)
  spec = backend.spec
  num_blocks = len(lens) * width + 3
  bt = rng.permutation(num_blocks)[:len(lens) * width].reshape(len(lens), width)
  cache = backend.allocate_kv_cache(num_blocks)
  poison(rng, cache, spec)
  slots = np.concatenate([bt[s, np.arange(ln) // n] * n + np.arange(ln) % n
                          for s, ln in enumerate(lens)])
  key, value = (rand_bf16(rng, (len(slots), h, d)) for _ in range(2))
  backend.do_kv_cache_update(key, value, cache, torch.from_numpy(slots))
  md = _decode_metadata("cpu", lens, width, num_blocks, rng)
  md.block_table.copy_(torch.from_numpy(bt.astype(np.int32)))
  q = rand_bf16(rng, (len(lens) + 1, h * g, d))          # one padding row: its output is 0
  out = torch.full_like(q, float("nan"))
  run = MDT.TorchDecode(spec, h * g, d ** -0.5, opts.get("sliding_window"),
                        opts.get("soft_cap"), sinks)
  run(q, L.physical_tensor(cache, spec), *md.int32_tensors(), out)
  (entry,) = run._compiled.values()
  assert (entry.st.num_splits > 1) == (width == 32)
  want = _reference(to_jnp(q), cache_array(cache, spec), spec, md, None, None, scale=d ** -0.5,
                    sinks=None if sinks is None else jnp.asarray(sinks), **opts)
  got = out.float().numpy()
  assert np.isfinite(got).all() and not got[-1].any()
  np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)


# -- CUDA: numerics, graph capture --------------------------------------------------------------
def _reference(q, cache, spec, md, ks, vs, **opts):
  meta = {n: on_cpu(getattr(md, n).cpu().numpy())
          for n in ("query_start_loc", "seq_lens", "block_table")}
  fn = jax.jit(lambda q, c: kvjax.unified_attention(q, c, spec, k_scale=ks, v_scale=vs,
                                                    **meta, impl="reference", **opts))
  return np.asarray(fn(q, cache).astype(jnp.float32))


LAUNCH_CASES = [
    # cache_dtype, layout, H, G, D, N, seq_lens, width, options
    ("bfloat16", "NHD", 8, 4, 128, 16, [1, 300, 0, 511], 32, dict(query_counts=[1, 1, 0, 1])),
    ("bfloat16", "HND", 2, 16, 64, 32, [40, 129], 8, dict(sliding_window=50, soft_cap=20.0)),
    ("fp8", "NHD", 4, 2, 128, 16, [77, 5, 260], 20, dict(sinks=True)),
    ("fp8", "HND", 1, 1, 256, 64, [1000], 16, dict(sinks=True, sliding_window=300)),
    ("float16", "NHD", 2, 7, 64, 16, [33, 2], 4, {}),
    ("int8_per_token_head", "NHD", 2, 4, 128, 16, [300, 1, 77], 24, dict(sinks=True)),
    ("fp8_per_token_head", "HND", 4, 2, 64, 16, [40, 129], 12,
     dict(sliding_window=50, soft_cap=20.0)),
    ("fp8_per_token_head", "NHD", 1, 8, 128, 16, [4000, 3, 2500], 256, {}),   # split merge
    # block tables of >= 2 * MIN_STEPS_PER_SPLIT key steps: split partials merged in torch
    ("bfloat16", "NHD", 2, 4, 128, 16, [4000, 3, 2500], 256, dict(sinks=True)),
    # prefills of >= 128 tokens (with decodes): the ragged kernel
    ("bfloat16", "NHD", 2, 4, 128, 16, [300, 40, 129], 24,
     dict(query_counts=[200, 1, 129], sinks=True)),
    ("float16", "HND", 4, 2, 64, 32, [700, 5], 24,
     dict(query_counts=[128, 1], sliding_window=100, soft_cap=30.0)),
]


@requires_launch
@pytest.mark.parametrize("cache_dtype,layout,h,g,d,n,lens,width,opts", LAUNCH_CASES)
def test_launch_equals_reference(rng, cache_dtype, layout, h, g, d, n, lens, width, opts):
  dtype = torch.float16 if cache_dtype == "float16" else torch.bfloat16
  opts = dict(opts)
  counts = opts.pop("query_counts", [1] * len(lens))
  if opts.pop("sinks", False):
    opts["sinks"] = rng.standard_normal(h * g).astype(np.float32)
  backend = tb.PagedAttentionBackend(h * g, h, d, n, cache_dtype, layout, dtype=dtype, **opts)
  spec = backend.spec
  # each sequence its own blocks; only its tokens written: every other byte is random (NaN
  # and inf included), in the tail of a last page too
  num_blocks = len(lens) * width + 4
  bt = rng.permutation(num_blocks)[:len(lens) * width].reshape(len(lens), width)
  cache = backend.allocate_kv_cache(num_blocks, device="cuda")
  poison(rng, cache, spec)
  slots = np.concatenate([bt[s, np.arange(ln) // n] * n + np.arange(ln) % n
                          for s, ln in enumerate(lens)])
  key, value = (rand_bf16(rng, (len(slots), h, d), "cuda").to(dtype) for _ in range(2))
  scales = (0.5, 2.0) if spec.format.has_tensor_scales else (None, None)
  backend.do_kv_cache_update(key, value, cache, torch.from_numpy(slots).cuda(), *scales)
  md = _decode_metadata("cuda", lens, width, num_blocks, rng, counts)
  md.block_table.copy_(torch.from_numpy(bt.astype(np.int32)))
  rows = sum(counts) + 1                          # one padding row: its output is 0
  q = rand_bf16(rng, (rows, h * g, d), "cuda").to(dtype)
  out = torch.full_like(q, float("nan"))
  assert backend.direct_reason("cuda", md) is None
  ks = torch.tensor([scales[0]], device="cuda") if scales[0] else None
  backend.forward(q, cache, md, out, k_scale=ks, v_scale=scales[1])
  kind = "decode" if max(counts) <= 1 else "ragged"
  assert backend.last_path == f"mosaic_gpu {kind} launched from torch"
  js = [None if s is None else jnp.float32(s) for s in scales]
  want = _reference(to_jnp(q), cache_array(cache, spec), spec, md, *js,
                    scale=d ** -0.5, **opts)
  got = out.float().cpu().numpy()
  assert np.isfinite(got).all()
  qsl = md.query_start_loc.cpu().numpy()
  seq_of_row = np.searchsorted(qsl, np.arange(rows), side="right") - 1
  no_keys = (seq_of_row >= len(lens)) | (np.asarray(lens + [0])[seq_of_row] == 0)
  assert no_keys[-1] and not got[no_keys].any()
  np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@requires_launch
@pytest.mark.parametrize("layout,cache_dtype", [("NHD", "bfloat16"), ("HND", "fp8")])
def test_layered_cache_launches_every_layer(rng, layout, cache_dtype):
  """A layered (cross-layer) cache: writes and decode attention of each layer launched from
  torch (the layer an operand of one program), equal to the reference over that layer; the
  other layers' bytes untouched by a layer's write."""
  h, g, d, n, layers, num_blocks = 2, 4, 128, 16, 3, 24
  backend = tb.PagedAttentionBackend(h * g, h, d, n, cache_dtype, layout)
  spec = backend.spec
  cache = backend.allocate_kv_cache(num_blocks, device="cuda", num_layers=layers)
  poison(rng, cache, spec)
  scales = (0.5, 0.25) if spec.format.has_tensor_scales else (None, None)
  md = _decode_metadata("cuda", [70, 5, 200], 16, num_blocks, rng)
  slots = torch.arange(num_blocks * n, device="cuda")
  for layer in range(layers):
    before = cache_array(cache, spec)
    key, value = (rand_bf16(rng, (num_blocks * n, h, d), "cuda") for _ in range(2))
    backend.do_kv_cache_update(key, value, cache, slots, *scales, layer=layer)
    assert backend.last_write_path == "mosaic_gpu write launched from torch"
    after = np.asarray(cache_array(cache, spec)).view(np.uint8)
    others = [i for i in range(layers) if i != layer]
    axis = spec.layer_axis
    np.testing.assert_array_equal(np.take(after, others, axis=axis),
                                  np.take(np.asarray(before).view(np.uint8), others, axis=axis))
    q = rand_bf16(rng, (3, h * g, d), "cuda")
    out = torch.full_like(q, float("nan"))
    backend.forward(q, cache, md, out, *scales, layer=layer)
    assert backend.last_path == "mosaic_gpu decode launched from torch"
    js = [None if x is None else jnp.float32(x) for x in scales]
    meta = {k: on_cpu(getattr(md, k).cpu().numpy())
            for k in ("query_start_loc", "seq_lens", "block_table")}
    want = np.asarray(jax.jit(lambda q, c: kvjax.unified_attention(
        q, c, spec, scale=d ** -0.5, k_scale=js[0], v_scale=js[1], impl="reference",
        layer=layer, **meta))(to_jnp(q), cache_array(cache, spec)), np.float32)
    np.testing.assert_allclose(out.float().cpu().numpy(), want,
                               atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@requires_launch
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8", "fp8_per_token_head"])
def test_captured_decode_step_replays_new_contents(rng, cache_dtype):
  """Four layers of decode attention captured the way vLLM captures a step (a side stream,
  the graph's own memory pool, static input tensors), replayed after new queries, lengths
  and block tables are copied into those tensors; then a step under
  ``torch.cuda.set_sync_debug_mode("error")``."""
  h, g, d, n, layers, num_blocks, width, rows = 2, 4, 128, 16, 4, 64, 16, 8
  backend = tb.PagedAttentionBackend(h * g, h, d, n, cache_dtype)
  caches = [backend.allocate_kv_cache(num_blocks, device="cuda") for _ in range(layers)]
  for c in caches:
    poison(rng, c, backend.spec)
    kv = rand_bf16(rng, (num_blocks * n, h, d), "cuda")
    backend.do_kv_cache_update(kv, kv * 0.5, c, torch.arange(num_blocks * n, device="cuda"),
                               0.5, 0.5)
  ks = torch.tensor([0.5], device="cuda")

  def new_inputs():
    lens = rng.integers(1, width * n, rows).astype(np.int32)
    return (rand_bf16(rng, (rows, h * g, d), "cuda"),
            torch.from_numpy(lens).cuda(),
            torch.from_numpy(rng.integers(0, num_blocks, (rows, width)).astype(np.int32)).cuda())
  q, lens, bt = new_inputs()
  md = tb.PagedAttentionMetadata(
      query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device="cuda"), seq_lens=lens,
      block_table=bt, slot_mapping=torch.full((rows,), -1, dtype=torch.int32, device="cuda"),
      max_query_len=1, max_seq_len=width * n)
  outs = [torch.empty_like(q) for _ in range(layers)]

  def step():
    x = q
    for c, o in zip(caches, outs):
      backend.forward(x, c, md, o, k_scale=ks, v_scale=0.5)
      x = o * 2.0                                # the next layer's query depends on this one
  step()                                         # compiles, outside the capture
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    step()
  for _ in range(2):
    nq, nl, nb = new_inputs()
    q.copy_(nq), lens.copy_(nl), bt.copy_(nb)
    graph.replay()
    got = [o.float().cpu() for o in outs]
    step()                                       # eager, same inputs
    torch.cuda.synchronize()
    for a, b in zip(got, outs):
      torch.testing.assert_close(a, b.float().cpu(), rtol=0, atol=0)
  assert backend.last_path == "mosaic_gpu decode launched from torch"
  torch.cuda.set_sync_debug_mode("error")
  try:
    step()
  finally:
    torch.cuda.set_sync_debug_mode("default")
  torch.cuda.synchronize()
  want = _reference(to_jnp(q), cache_array(caches[0], backend.spec), backend.spec, md,
                    jnp.float32(0.5), jnp.float32(0.5), scale=d ** -0.5)
  np.testing.assert_allclose(outs[0].float().cpu().numpy(), want,
                             atol=2e-2 * np.abs(want).max(), rtol=2e-2)




def _vllm_config(cache_dtype, hq):
  model = SimpleNamespace(get_num_attention_heads=lambda parallel: hq, dtype=torch.bfloat16)
  return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                         parallel_config=None)


def test_adapter_declares_graph_capture_only_where_it_launches():
  spec = SimpleNamespace(num_kv_heads=2, head_size=128, block_size=16, dtype=torch.bfloat16)
  got = tb.KVJaxAttentionMetadataBuilder.get_cudagraph_support(_vllm_config("auto", 8), spec)
  want = "NEVER" if _launch_reason() else "UNIFORM_SINGLE_TOKEN_DECODE"
  assert got.name == want
  got = tb.KVJaxAttentionMetadataBuilder.get_cudagraph_support(
      _vllm_config("int8_per_token_head", 8), spec)
  assert got.name == "NEVER"


@requires_launch
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8"])
def test_adapter_decode_step_captured_as_vllm_captures_it(rng, cache_dtype):
  """Three layers of vLLM's decode step (``do_kv_cache_update`` then ``forward`` per layer)
  through the adapter, padded to a graph size (5 real requests of 8 rows: padding rows
  with slot -1 and zero-length sequences), warmed up eagerly, captured into one graph, then
  replayed with new contents in the same buffers: outputs and cache bytes equal an eager
  run of the same inputs, and the output equals kvjax's reference."""
  from torch_bridge.vllm_adapter import KVJaxAttentionImpl
  h, g, d, n, layers, num_blocks, rows, real = 2, 4, 128, 16, 3, 40, 8, 5
  impls = [KVJaxAttentionImpl(h * g, d, d ** -0.5, h, kv_cache_dtype=cache_dtype)
           for _ in range(layers)]
  be = tb.PagedAttentionBackend(h * g, h, d, n, cache_dtype)
  caches = [be.allocate_kv_cache(num_blocks, device="cuda") for _ in range(layers)]
  for c in caches:
    poison(rng, c, be.spec)
    kv = rand_bf16(rng, (num_blocks * n, h, d), "cuda")
    be.do_kv_cache_update(kv, kv, c, torch.arange(num_blocks * n, device="cuda"), 0.5, 0.5)
  layer = SimpleNamespace(_k_scale=torch.tensor([0.5], device="cuda"),
                          _v_scale=torch.tensor([0.5], device="cuda"))
  query = torch.zeros(rows, h * g, d, dtype=torch.bfloat16, device="cuda")
  key, value = (torch.zeros(rows, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
  slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
  qsl = torch.tensor(list(range(real + 1)) + [real] * (rows - real), dtype=torch.int32,
                     device="cuda")
  lens = torch.zeros(rows, dtype=torch.int32, device="cuda")
  table = torch.zeros(rows, 8, dtype=torch.int32, device="cuda")
  outs = [torch.zeros(rows, h * g, d, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]

  def new_contents():
    query.copy_(rand_bf16(rng, tuple(query.shape), "cuda"))
    key.copy_(rand_bf16(rng, tuple(key.shape), "cuda"))
    value.copy_(rand_bf16(rng, tuple(value.shape), "cuda"))
    blocks = rng.permutation(num_blocks)[:real * 8].reshape(real, 8)
    ln = rng.integers(1, 8 * n, real)
    table[:real] = torch.from_numpy(blocks.astype(np.int32))
    lens[:real] = torch.from_numpy(ln.astype(np.int32))
    pos = ln - 1                                 # the new token's position
    slots[:real] = torch.from_numpy(blocks[np.arange(real), pos // n] * n + pos % n)

  md = tb.KVJaxAttentionMetadata(query_start_loc=qsl, seq_lens=lens, block_table=table,
                                 slot_mapping=slots, max_query_len=1, max_seq_len=8 * n,
                                 num_actual_tokens=real)

  def step():
    for impl, c, o in zip(impls, caches, outs):
      impl.do_kv_cache_update(layer, key, value, c, slots)
      impl.forward(layer, query, key, value, c, md, o)
  new_contents()
  step()                                         # warm-up: compiles, outside the capture
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    step()
  for _ in range(2):
    new_contents()
    graph.replay()
    got = [o.clone() for o in outs]
    got_cache = [cache_array(c, be.spec) for c in caches]
    step()
    torch.cuda.synchronize()
    for a, b in zip(got, outs):
      assert torch.equal(a[:real], b[:real])
    for a, c in zip(got_cache, caches):
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                    np.asarray(cache_array(c, be.spec)).view(np.uint8))
  ks = jnp.float32(0.5)
  want = _reference(to_jnp(query), cache_array(caches[0], be.spec), be.spec, md, ks, ks,
                    scale=d ** -0.5)
  np.testing.assert_allclose(outs[0][:real].float().cpu().numpy(), want[:real],
                             atol=2e-2 * np.abs(want).max(), rtol=2e-2)


@pytest.mark.parametrize("bq", [16, 64])
def test_torch_tile_schedule_equals_the_kernels(rng, bq):
  """The ragged kernel's per-tile metadata made by torch ops (the launch path) equals the one
  the JAX entry makes, on random ragged batches (zero-length sequences, padding tokens)."""
  from pallas_kernels.mosaic_gpu import tiles as TL
  from torch_bridge import mosaic_ragged as MRT
  for _ in range(20):
    s = int(rng.integers(1, 9))
    q_lens = rng.integers(0, 3 * bq, s) * (rng.random(s) < 0.8)
    t = int(q_lens.sum() + rng.integers(0, 5))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = (q_lens + rng.integers(0, 500, s)).astype(np.int32)
    num_tiles = TL.num_tiles_bound(t, s, bq)
    want = TL.tile_metadata(jnp.asarray(qsl), jnp.asarray(lens), 7, t, num_tiles, bq)
    got = MRT.tile_metadata(torch.from_numpy(qsl), torch.from_numpy(lens), 7, t, num_tiles, bq,
                            torch.arange(num_tiles, dtype=torch.int32))
    np.testing.assert_array_equal(got.numpy(), np.asarray(want))
