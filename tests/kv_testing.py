"""Shared test helpers: random K/V, poisoned caches, per-format round-trip error bounds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import KVCacheSpec, token_major
from kvjax import formats as F
from kvjax import rotation
from kvjax.reference import write_kv as reference_write_kv

ALL_CACHE_DTYPES = tuple(F.CACHE_FORMATS)

# The reference write and read, jitted (the spec is a static pytree: one compile per spec and
# shapes). Eagerly, every jnp op of the quantizers compiles on its own for each new shape
# (5-7 s of CPU for one int4 or nvfp4 batch); tests whose subject is not the eager path build
# their inputs with these.
jit_reference_write = jax.jit(reference_write_kv)


@jax.jit
def jit_reference_read(cache, spec, slots, k_scale=None, v_scale=None):
  """``kvjax.read_kv(..., impl="reference")`` under jit."""
  import kvjax
  return kvjax.read_kv(cache, spec, slots, k_scale=k_scale, v_scale=v_scale, impl="reference")


def spec_for(cache_dtype, layout="NHD", **kw):
  """A KVCacheSpec; nvfp4 is always HND."""
  kw.setdefault("num_kv_heads", 2)
  kw.setdefault("head_size", 64)
  kw.setdefault("block_size", 16)
  if cache_dtype == "nvfp4":
    layout = "HND"
  return KVCacheSpec(cache_dtype=cache_dtype, layout=layout, **kw)


def random_kv(rng, spec: KVCacheSpec, num_tokens: int, spread: float = 3.0):
  """Random key/value ``[T, H, D]`` in the spec's dtype, row magnitudes varying over decades."""
  def one():
    x = rng.standard_normal((num_tokens, spec.num_kv_heads, spec.head_size))
    x *= np.exp(rng.uniform(-spread / 3, spread / 3, (num_tokens, spec.num_kv_heads, 1)))
    return jnp.asarray(x.astype(np.float32)).astype(spec.dtype)
  return one(), one()


def poisoned_cache(rng, spec: KVCacheSpec, num_blocks: int, num_layers=None):
  """A cache of random bytes of the spec's physical shape and storage dtype (layered with
  ``num_layers``).

  Float storage gets random *finite* bit patterns: XLA on CPU may canonicalize
  NaN payloads of elements it passes through, and a NaN payload is not data.
  """
  shape = spec.physical_shape(num_blocks, num_layers)
  nbytes = int(np.prod(shape)) * spec.itemsize
  raw = rng.integers(0, 256, nbytes, dtype=np.uint8).view(spec.storage_dtype).copy()
  if spec.storage_dtype.kind in "fV":  # numpy floats and ml_dtypes (bf16, fp8)
    bad = ~np.isfinite(raw.astype(np.float32))
    raw[bad] = rng.uniform(-100, 100, int(bad.sum())).astype(spec.storage_dtype)
  return jnp.asarray(raw.reshape(shape))


def as_bytes(x):
  return np.asarray(x).view(np.uint8)


def random_slots(rng, spec: KVCacheSpec, num_blocks: int, num_tokens: int, pad: int = 0):
  """Duplicate-free random slots, followed by ``pad`` padding (-1) slots, as int32."""
  slots = rng.choice(num_blocks * spec.block_size, num_tokens, replace=False)
  return jnp.asarray(np.concatenate([slots, -np.ones(pad, np.int64)]).astype(np.int32))


def roundtrip_bound(spec: KVCacheSpec, x, k_scale=None):
  """Per-element bound on |read(write(x)) - x| for the spec's format, float32 ``x [T, H, D]``."""
  fmt = spec.format
  x = np.asarray(x, np.float32)
  ax = np.abs(x)
  if fmt.kind == F.PLAIN:
    if spec.storage_dtype == spec.dtype:
      return np.zeros_like(ax)
    if spec.storage_dtype == np.dtype(np.float16):   # half an ulp, or of a subnormal step
      return ax * 2.0 ** -11 + 2.0 ** -25
    eps = {2: 2.0 ** -8, 4: 0.0}[spec.itemsize]        # bf16 / float32 storage
    return ax * eps + 1e-30
  if fmt.kind == F.FP8_PER_TENSOR:
    s = 1.0 if k_scale is None else np.asarray(k_scale, np.float32)
    s = s[:, None] if np.ndim(s) == 1 else s
    rel = 2.0 ** -4 if fmt.quant == np.dtype(jnp.float8_e4m3fn) else 2.0 ** -3
    tiny = 2.0 ** -9 if rel == 2.0 ** -4 else 2.0 ** -16
    return ax * rel + tiny * s
  if fmt.kind == F.PER_TOKEN_HEAD:
    # Beyond the rounding step itself, float32 rounding of x * (1/s) (a value on a rounding
    # boundary may go either way) and of q * s (+ zero point): relative to |x| and to the
    # row's scale, so no magnitude of the data can break the bound.
    if fmt.quant == "int4":
      # quantized rotated (y = H(x * signs), rounded to the model dtype): half a step of y,
      # plus y's rounding; un-rotating averages y's errors, so they bound x's
      y = np.asarray(rotation.rht(x), np.float64)
      eps = {2: 2.0 ** -8, 4: 2.0 ** -23}[np.dtype(spec.dtype).itemsize]
      if np.dtype(spec.dtype) == np.dtype(np.float16):
        eps = 2.0 ** -10
      err = ((y.max(-1) - y.min(-1)) / 30 + np.abs(y).max(-1) * eps) * (1 + 1e-5) + 1e-6
      return np.broadcast_to(err[..., None], x.shape)
    scale = np.maximum(ax.max(-1) / fmt.qmax, 1e-6)[..., None]
    if fmt.quant == np.dtype(np.int8):
      return scale * 0.5 + ax * 2.0 ** -21
    return ax * 2.0 ** -4 + scale * 2.0 ** -9
  # nvfp4: e2m1's widest step is 2 on a grid topping at 6, plus e4m3 rounding of the scale
  g = ax.reshape(x.shape[:-1] + (x.shape[-1] // 16, 16)).max(-1, keepdims=True)
  return np.broadcast_to(g * 0.25, x.shape[:-1] + (x.shape[-1] // 16, 16)).reshape(x.shape)


def assert_roundtrip(spec, x, back, k_scale=None):
  x = np.asarray(jnp.asarray(x).astype(jnp.float32))
  back = np.asarray(back)
  bound = roundtrip_bound(spec, x, k_scale)
  err = np.abs(back - x)
  bad = ~(err <= bound)     # a NaN error is bad too
  assert not bad.any(), (f"{spec.cache_dtype}: {bad.sum()} of {bad.size} elements beyond bound; "
                         f"worst err {err[bad].max()} vs bound {bound[bad].min()}")
  # and the bound is not vacuous: quantized formats do lose something, plain ones nothing
  assert np.isfinite(back).all()


def jit_write(impl="reference", interpret=None):
  """``write_kv`` jitted with the cache donated (spec static)."""
  import kvjax

  def f(cache, key, value, slots, spec, k_scale=None, v_scale=None):
    return kvjax.write_kv(cache, key, value, slots, spec, k_scale=k_scale, v_scale=v_scale,
                          impl=impl, interpret=interpret)
  return jax.jit(f, static_argnums=4, donate_argnums=0)


def nan_cache(spec: KVCacheSpec, num_blocks: int):
  """A cache whose every byte is 0xFF: NaN in every float format and as every float32 scale."""
  shape = spec.physical_shape(num_blocks)
  raw = np.full(int(np.prod(shape)) * spec.itemsize, 0xFF, np.uint8)
  return jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))


RAGGED_Q_LENS = (7, 1, 20, 0, 1, 12)
RAGGED_CTX_LENS = (0, 40, 17, 5, 0, 33)
RAGGED_PAD = 3


def shuffled_block_table(rng, pages, spare: int, unused: str):
  """(block_table int32 ``[S, max(pages) + 1]``, num_blocks): sequence s owns ``pages[s]``
  pages drawn in random order from ``sum(pages) + spare`` blocks. Entries past a sequence's
  pages name ``unused``: "written" (the sequence's first page, or another sequence's) or
  "spare" (the last block of the permutation, which no sequence owns when ``spare > 0``)."""
  num_blocks = int(np.sum(pages)) + spare
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(pages), int(np.max(pages)) + 1), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[-1] if unused == "spare" else perm[used] if p else perm[0]
    used += p
  return bt, num_blocks


def poisoned_ragged_batch(rng, spec, hq, q_lens=RAGGED_Q_LENS, ctx_lens=RAGGED_CTX_LENS, pad=RAGGED_PAD, k_scale=None,
                    v_scale=None):
  """(q, cache, query_start_loc, seq_lens, block_table) over shuffled, poisoned pages.

  A ragged batch (prefills on cached prefixes, decodes, empty sequences, ``pad`` padding
  tokens); block-table entries past a sequence name a written page, and slots past each
  sequence's end hold huge values that must never be visible."""
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(ctx_lens)
  pages = -(-seq_lens // n)
  bt, num_blocks = shuffled_block_table(rng, pages, spare=2, unused="written")
  shape = spec.physical_shape(num_blocks)
  raw = np.full(int(np.prod(shape)) * spec.itemsize, 0xFF, np.uint8)
  cache = jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))
  slots = np.concatenate([bt[s, np.arange(p * n) // n] * n + np.arange(p * n) % n
                          for s, p in enumerate(pages)])
  live = np.concatenate([np.arange(p * n) < L for p, L in zip(pages, seq_lens)])
  kv = rng.standard_normal((2, len(slots), spec.num_kv_heads, spec.head_size))
  kv[:, ~live] *= 1e4                                # past each sequence's end: never visible
  k, v = (jnp.asarray(x, spec.dtype) for x in kv)
  cache = jit_reference_write(cache, k, v, jnp.asarray(slots, jnp.int32), spec, k_scale, v_scale)
  t = int(np.sum(q_lens)) + pad
  q = jnp.asarray(rng.standard_normal((t, hq, spec.head_size)), spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def assert_written_as_reference(got, want, spec: KVCacheSpec, slots):
  """``got`` == ``want`` (physical caches of the spec, numpy or JAX), bit for bit; where JAX
  runs on a GPU, the quantized per-token-head rows of ``slots`` may differ by one
  quantization step of the stored (rotated for int4) row: XLA's GPU compile of the reference
  and the Triton kernel round ties of ``x * (1/s) (+ zp)`` differently in the last bit (fma
  contraction). Every other row must still agree bit for bit."""
  got, want = np.asarray(got), np.asarray(want)
  if jax.default_backend() != "gpu" or not spec.codec.has_row_scales:
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8),
                                  want.reshape(-1).view(np.uint8))
    return
  slots = np.asarray(slots)
  slots = slots[slots >= 0]
  blk, off = slots // spec.block_size, slots % spec.block_size
  written = np.zeros((got.shape[0], spec.block_size), bool)
  written[blk, off] = True
  rows_got = np.asarray(token_major(jnp.asarray(got), spec))          # [B, N, H, C]
  rows_want = np.asarray(token_major(jnp.asarray(want), spec))
  np.testing.assert_array_equal(rows_got[~written].view(np.uint8),
                                rows_want[~written].view(np.uint8))
  for a, b in zip(spec.codec.dequantize(jnp.asarray(got), spec),
                  spec.codec.dequantize(jnp.asarray(want), spec)):
    a, b = np.asarray(a)[blk, off], np.asarray(b)[blk, off]        # [T, H, D] stored rows
    if spec.codec.quant == "int4":   # asymmetric: range / 15, and up to two steps: a zero
      # point one off (contracted differently) shifts every code by one, and a code already
      # at 15 stays clipped there
      step = 2 * (b.max(-1, keepdims=True) - b.min(-1, keepdims=True)) / 15
    else:                                                          # symmetric: amax / qmax
      step = np.abs(b).max(-1, keepdims=True) / spec.codec.qmax
    assert (np.abs(a - b) <= step * (1 + 1e-5) + 1e-6).all()


def nonfinite_spread(cache_dtype: str, head_size: int, col: int):
  """docs/edges.md's contract: (the elements of a (token, head) row that read back non-finite
  after a NaN at column ``col``, those after a +Inf there)."""
  element, row = {col}, set(range(head_size))
  group = set(range(col // 16 * 16, col // 16 * 16 + 16))
  return {
      "auto": (element, element), "float16": (element, element), "float32": (element, element),
      "fp8": (element, set()),                 # Inf saturates to 448 * k_scale
      "fp8_e5m2": (element, set()),            # Inf saturates to 57344 * k_scale
      "int8_per_token_head": (row, row), "fp8_per_token_head": (row, row),
      "int4_per_token_head": (row, row),
      "nvfp4": (group, set()),                 # Inf: the group's scale saturates, stays finite
  }[cache_dtype]


def assert_step_lowers_for_cuda(step, traced, params, caches):
  """A serving example's jitted step (``step(params, caches, tokens, scales, md,
  max_query_len=...)``) lowers for CUDA on this machine with the Triton cache write and
  attention in it, for a decode (4 tokens, query length 1) and a 16-token prefill, each one
  traced program."""
  from jax import export   # noqa: PLC0415
  allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  i32 = lambda *shape: np.zeros(shape, np.int32)
  for t, max_query_len in ((4, 1), (16, 16)):        # decode kernel, ragged kernel
    md = dict(query_start_loc=i32(5), seq_lens=i32(4), block_table=i32(4, 3),
              slot_mapping=i32(t), positions=i32(t), seq_ids=i32(t))
    fn = jax.jit(lambda p, c, tok, m, mql=max_query_len: step(p, c, tok, {}, m,
                                                                 max_query_len=mql))
    text = export.export(fn, platforms=["cuda"], disabled_checks=allow)(
        params, caches, i32(t), md).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") >= 2    # the cache write and the attention
  assert traced == [(4, 1), (16, 16)]
