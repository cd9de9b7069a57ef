"""Compiled check that a write never touches bytes it was not asked to touch (GPU).

    PYTHONUNBUFFERED=1 python benchmarks/check_write_bounds.py [--impl pallas]

For each cache format: 8 buffers of random bytes are allocated before the cache and 8 after it
(so the cache has live neighbours in device memory), then ``kvjax.write_kv`` runs under
``jax.jit(..., donate_argnums=0)`` (in place) with slots past the end (B*N, B*N+5), slots that
wrap a 32-bit row index (2**30+5, 2**31-1), negative slots and one valid slot. Pass: every
neighbour is bit-identical; in the cache only the valid slot's row changed (for nvfp4, whose
scales are scattered through the page, only its block). A second write with only invalid slots
must leave the cache bit-identical. Runs on CPU too (Pallas interpret mode).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402

FORMATS = (("bfloat16", "NHD"), ("bfloat16", "HND"), ("float32", "NHD"), ("fp8", "NHD"),
           ("int8_per_token_head", "NHD"), ("fp8_per_token_head", "HND"),
           ("int4_per_token_head", "NHD"), ("nvfp4", "HND"))
B, H, D, N = 4, 2, 32, 16
VALID = 3                          # block 0, token 3


def _bytes(x):
  return np.asarray(jax.device_get(x)).view(np.uint8).copy()


def check(cd, layout, impl, interpret, rng):
  spec = kvjax.KVCacheSpec(num_kv_heads=H, head_size=D, block_size=N, cache_dtype=cd,
                           layout=layout)
  shape = spec.physical_shape(B)
  nbytes = int(np.prod(shape)) * spec.itemsize

  def random_buffer():
    return jnp.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8))

  before = [random_buffer() for _ in range(8)]
  raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
  cache = jax.lax.bitcast_convert_type(
      jnp.asarray(raw.reshape(shape + (spec.itemsize,)) if spec.itemsize > 1
                  else raw.reshape(shape)), spec.storage_dtype)
  after = [random_buffer() for _ in range(8)]
  jax.block_until_ready((before, cache, after))
  neighbours = [_bytes(x) for x in before + after]
  original = _bytes(cache)
  num_slots = B * N
  bad = [num_slots, num_slots + 5, 2**30 + 5, 2**31 - 1, -1, -(2**31)]
  k = jnp.asarray(rng.standard_normal((len(bad) + 1, H, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((len(bad) + 1, H, D)), jnp.bfloat16)
  ks = 1.0 if spec.format.has_tensor_scales else None
  write = jax.jit(lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks,
                                                    impl=impl, interpret=interpret),
                  donate_argnums=0)
  problems = []
  # (1) only invalid slots: nothing changes.
  only_bad = jnp.asarray(bad, jnp.int32)
  cache = write(cache, k[:len(bad)], v[:len(bad)], only_bad)
  if not np.array_equal(_bytes(cache), original):
    problems.append("invalid slots changed the cache")
  # (2) invalid slots around one valid slot: only that row (block) changes.
  slots = jnp.asarray(bad[:3] + [VALID] + bad[3:], jnp.int32)
  cache = write(cache, k, v, slots)
  got = _bytes(cache).reshape(original.shape)
  changed = got != original
  allowed = np.zeros(shape + ((spec.itemsize,) if spec.itemsize > 1 else ()), bool)
  if cd == "nvfp4":
    allowed[0] = True
  elif layout == "NHD":
    allowed[0, VALID] = True
  else:
    allowed[0, :, VALID] = True
  allowed = allowed.reshape(changed.shape)
  if np.any(changed & ~allowed):
    problems.append(f"{int(np.sum(changed & ~allowed))} bytes changed outside the valid row")
  if not np.any(changed & allowed):
    problems.append("the valid slot was not written")
  for i, (buf, old) in enumerate(zip(before + after, neighbours)):
    if not np.array_equal(_bytes(buf), old):
      problems.append(f"neighbour buffer {i} changed")
  return problems


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--impl", default="pallas")
  ap.add_argument("--smoke", action="store_true", help="CPU (interpret mode); same checks")
  args = ap.parse_args()
  interpret = jax.default_backend() == "cpu"
  rng = np.random.default_rng()
  print(f"device {jax.devices()[0]}, impl={args.impl}, interpret={interpret}", flush=True)
  failed = 0
  for cd, layout in FORMATS:
    try:
      problems = check(cd, layout, args.impl, interpret, rng)
    except Exception as e:  # noqa: BLE001 - report and go on
      problems = [f"{type(e).__name__}: {str(e)[:300]}"]
    failed += bool(problems)
    print(f"write bounds {cd:20s} {layout}: {'PASS' if not problems else 'FAIL ' + '; '.join(problems)}",
          flush=True)
  print(f"write bounds: {len(FORMATS) - failed} passed, {failed} failed", flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
