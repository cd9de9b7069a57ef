"""Digests of every kernel's lowered program, exported on this machine for the platform it
runs on (CUDA for the Triton and Mosaic GPU kernels, TPU for Mosaic TPU; no accelerator
needed), source locations stripped: two source trees whose digests are equal lower every
kernel to the same program, so a change between them cannot change a kernel's speed.

Programs: write (8 and 8192 tokens), read, and attention at decode and prefill shapes up to
64 x 4096 and 8 x 32768, for every cache dtype and layout (head sizes 128 and 64), through
the public ops with each kernel named. The Mosaic GPU kernels lower only on jax >= 0.11
(small shapes: minutes each on a CPU otherwise)::

    PYTHONPATH=path/to/old/tree python benchmarks/tools/lowering_digest.py > before.json
    python benchmarks/tools/lowering_digest.py --compare before.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(os.path.dirname(_HERE)))   # after PYTHONPATH: a tree given wins

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402

import kvjax  # noqa: E402

# no source locations in the lowered IR (a moved line would change every digest)
mlir.source_info_to_location = lambda *a, **k: ir.Location.unknown()


def _pretend_hopper():
  """Let the Mosaic GPU kernels lower for CUDA on a machine without a GPU (jax >= 0.11)."""
  try:
    from pallas_kernels.mosaic_gpu import ragged_attention as R
  except ImportError:
    return
  R._gpu_reason = lambda: None


_pretend_hopper()
# the ops decide for the platform exported for, not this machine's
_TARGET = ["gpu"]
kvjax.registry.platform_of = lambda array: _TARGET[0]
kvjax.registry.host_platforms = lambda: (_TARGET[0],)

ALLOW = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
         export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),
         export.DisabledSafetyCheck.custom_call("mosaic_gpu")]

#: (name, num_seqs, query len, context len incl. the query, max_blocks, num_blocks)
SHAPES = (("decode_small", 4, 1, 50, 8, 64), ("decode_64x4096", 64, 1, 4096, 256, 16384),
          ("decode_8x32768", 8, 1, 32768, 2048, 16384), ("prefill_2x128", 2, 128, 160, 16, 64),
          ("prefill_4x4096", 4, 4096, 4096, 256, 1024))


def normalized(text: str) -> str:
  text = re.sub(r'loc\([^()]*(\([^()]*\))*[^()]*\)', '', text)
  text = re.sub(r"#loc\d*\s*=.*", "", text)
  text = re.sub(r"\S+\.py:\d+(:\d+)?", "SRC", text)
  return text


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def cases():
  for name, fmt in kvjax.CACHE_FORMATS.items():
    if name == "auto":
      continue
    for layout in fmt.codec.layouts:
      for d in (128, 64):
        spec = kvjax.KVCacheSpec(num_kv_heads=8, head_size=d, block_size=16, cache_dtype=name,
                                 layout=layout, dtype=jnp.bfloat16)
        yield spec


def programs(spec):
  ks = 0.5 if spec.format.has_tensor_scales else None
  i32 = jnp.int32
  for platform, impls in (("cuda", ("pallas", "mosaic_gpu")), ("tpu", ("mosaic_tpu",))):
    for impl in impls:
      # write (no mosaic_gpu write)
      if impl != "mosaic_gpu":
        for t in (8, 8192):
          def w(c, k, v, s, impl=impl):
            return kvjax.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks, impl=impl,
                                  interpret=False)
          args = (_sds(spec.physical_shape(1024), spec.storage_dtype),
                  _sds((t, spec.num_kv_heads, spec.head_size), jnp.bfloat16),
                  _sds((t, spec.num_kv_heads, spec.head_size), jnp.bfloat16), _sds((t,), i32))
          yield f"write/{impl}/T{t}", platform, w, args
      if impl == "pallas":
        def r(c, impl=impl):
          return kvjax.read_kv(c, spec, jnp.arange(4, dtype=i32), k_scale=ks, v_scale=ks,
                               impl=impl, interpret=False)
        yield f"read/{impl}", platform, r, (_sds(spec.physical_shape(64), spec.storage_dtype),)
      for sname, s, ql, ctx, mb, nb in SHAPES:
        if ((impl == "mosaic_gpu" or spec.head_size != 128)
            and not sname.endswith(("small", "2x128"))):
          continue          # Mosaic GPU: minutes each to lower on a CPU
        t = s * ql
        hq = 4 * spec.num_kv_heads
        def a(q, c, qsl, sl, bt, ql=ql, impl=impl):
          return kvjax.unified_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                         block_table=bt, scale=0.1, k_scale=ks, v_scale=ks,
                                         max_query_len=ql, impl=impl, interpret=False)
        args = (_sds((t, hq, spec.head_size), jnp.bfloat16),
                _sds(spec.physical_shape(nb), spec.storage_dtype), _sds((s + 1,), i32),
                _sds((s,), i32), _sds((s, mb), i32))
        yield f"attention/{impl}/{sname}", platform, a, args


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--compare", default=None, help="a JSON of an earlier run: list what differs")
  ap.add_argument("--save", default=None, help="folder: write each normalized program")
  ap.add_argument("--only", default=None, help="regex on case names")
  args = ap.parse_args()
  out = {}
  for spec in cases():
    for name, platform, fn, fargs in programs(spec):
      key = f"{spec.cache_dtype}/{spec.layout}/D{spec.head_size}/{name}"
      if args.only and not re.search(args.only, key):
        continue
      _TARGET[0] = {"cuda": "gpu", "tpu": "tpu"}[platform]
      try:
        text = export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=ALLOW)(*fargs).mlir_module()
        text = normalized(text)
        out[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
        if args.save:
          os.makedirs(args.save, exist_ok=True)
          with open(os.path.join(args.save, key.replace("/", "_") + ".mlir"), "w") as f:
            f.write(text)
      except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        out[key] = "ERR " + type(e).__name__ + ": " + re.sub(r"0x[0-9a-f]+", "", msg)[:160]
      print(key, out[key], file=sys.stderr, flush=True)
  print(f"kvjax from {os.path.dirname(kvjax.__file__)}", file=sys.stderr)
  if args.compare:
    with open(args.compare) as f:
      base = json.load(f)
    diff = sorted(k for k in set(base) | set(out) if base.get(k) != out.get(k))
    for k in diff:
      print(f"DIFF {k}: {base.get(k)} -> {out.get(k)}")
    print(f"{len(out)} programs, {len(diff)} differ")
    sys.exit(1 if diff else 0)
  print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
  main()
