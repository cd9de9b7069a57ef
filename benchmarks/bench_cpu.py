"""CPU attention: the XLA implementation (what ``auto`` runs on CPU) against the reference.

    python benchmarks/bench_cpu.py [--formats auto,fp8,int8_per_token_head] [--json PATH]

Problems: a decode of 8 sequences x 512 tokens and a prefill of 1 x 2,048 tokens (causal),
32 query heads, 8 KV heads, head size 128, 16-token pages, bf16 queries, on a cache of 4x
the batch's pages (the rest unused). Each implementation jitted; median milliseconds of 5
calls after a warm-up. "KV GB/s": the bytes of the batch's pages in the cache's format / time.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import common  # noqa: E402

log = functools.partial(print, flush=True)
PROBLEMS = {"decode 8 x 512": (8, 512, 1), "prefill 1 x 2048": (1, 2048, 2048)}
IMPLS = ("reference", "xla")


def median_ms(fn, *args, reps: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


def problem(rng, cache_dtype, num_seqs, seq_len, q_len):
  spec = kvjax.KVCacheSpec(8, 128, 16, cache_dtype=cache_dtype)
  pages = num_seqs * seq_len // spec.block_size
  kv = [jnp.asarray(rng.standard_normal((num_seqs * seq_len, 8, 128)), jnp.bfloat16)
        for _ in range(2)]
  order = rng.permutation(4 * pages)[:pages]          # the batch's pages, spread over the cache
  slots = (order[:, None] * spec.block_size + np.arange(spec.block_size)).reshape(-1)
  cache = kvjax.write_kv(spec.allocate(4 * pages), *kv, slots, spec)
  q = jnp.asarray(rng.standard_normal((num_seqs * q_len, 32, 128)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.arange(num_seqs + 1) * q_len,
              seq_lens=jnp.full((num_seqs,), seq_len),
              block_table=jnp.asarray(order.reshape(num_seqs, -1), jnp.int32))
  return spec, q, cache, meta, pages * spec.page_bytes


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--formats", default="auto,fp8,int8_per_token_head")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = []
  for name, (s, length, q_len) in PROBLEMS.items():
    for cache_dtype in args.formats.split(","):
      spec, q, cache, meta, nbytes = problem(rng, cache_dtype, s, length, q_len)
      row = dict(problem=name, cache_dtype=cache_dtype)
      for impl in IMPLS:
        fn = jax.jit(lambda q, c, m, impl=impl: kvjax.unified_attention(
            q, c, spec, scale=128 ** -0.5, max_query_len=q_len, impl=impl, **m))
        row[impl] = median_ms(fn, q, cache, meta, reps=3 if q_len > 1 else 5)
      row["speedup"] = row["reference"] / row["xla"]
      row["xla_kv_gb_s"] = nbytes / (row["xla"] * 1e-3) / 1e9
      rows.append(row)
      log(f"{name:17s} {cache_dtype:20s} reference {row['reference']:9.1f} ms   xla "
          f"{row['xla']:8.1f} ms   {row['speedup']:5.1f}x   xla {row['xla_kv_gb_s']:.2f} KV GB/s")
  path = common.output_path(args.json, "bench_cpu.json")
  if path:
    with open(path, "w") as f:
      json.dump(dict(rows=rows, cpus=os.cpu_count(), versions=common.versions(),
                     date=common.now_utc(), command=common.command_line()), f, indent=1)


if __name__ == "__main__":
  main()
