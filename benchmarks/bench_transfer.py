"""Disaggregated prefill/decode on one GPU: a prefill process offers requests' pages of all
layers, this (decode) process pulls them by token into its own caches, over each transport.

GPU:        PYTHONUNBUFFERED=1 python benchmarks/bench_transfer.py [--json PATH]
CPU smoke:  python benchmarks/bench_transfer.py --smoke        (socket only; tiny sizes)

Model: 32 layers, 8 KV heads, head size 128, 16-token pages, 2,048 tokens a request (NHD);
bf16 and fp8 caches, per-layer caches (a list of 32 arrays) and layered (one cross-layer
array). For each (transport, format, form, N requests): the prefill process fills its
pages, offers each request under its own token (all layers, one pull), and reports what an
offer cost it; this process pulls the N requests one after another into its own caches, each
pull ending when its pages are in the caches. Two rounds: the first maps the prefill side's
shareable memory as it comes (CUDA IPC; and compiles), the second, after the prefill side
released and offered again, is the timed steady state. GB/s = the requests' page bytes / the
pulls' wall time, next to this device's own copy of one request's bytes (an XLA copy, same
bytes counted) in the same run. For N > 1, also all N in one round
(``remote.pull_requests_layers``, what a decode step admitting N requests does; two more
rounds, the second timed). Small requests: one 16-token page x 32 layers, the median and 90th
percentile of 20 pulls' wall times (second round).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # two processes, one GPU

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax import pages  # noqa: E402
from kvjax.transfer import remote  # noqa: E402
from benchmarks import common  # noqa: E402

log = functools.partial(print, flush=True)
FORMATS = {"bf16": "auto", "fp8": "fp8"}
SMALL_PULLS = 20


class Shape:
  def __init__(self, smoke: bool):
    self.layers, self.heads, self.head_size, self.block = (2, 2, 32, 16) if smoke else (32, 8, 128,
                                                                                        16)
    self.tokens = 64 if smoke else 2048

  def spec(self, fmt):
    return kvjax.KVCacheSpec(self.heads, self.head_size, self.block, cache_dtype=FORMATS[fmt],
                             layout="NHD")


def filled_layers(spec, num_blocks, layers, layered, seed):
  """Page bytes that differ from byte to byte (a hash of the position, one fused XLA pass, no
  temporary): a layered array or a list of one-layer caches, committed to the first device."""
  shape = spec.physical_shape(num_blocks, layers) if layered else spec.physical_shape(num_blocks)
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[spec.itemsize]

  @jax.jit
  def fill(i):
    x = jax.lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1)
    for axis in range(len(shape) - 1):
      x = x * jnp.uint32(2654435761) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    x = (x + i) * jnp.uint32(2246822519)
    return jax.lax.bitcast_convert_type((x >> (32 - 8 * spec.itemsize)).astype(bits),
                                        spec.storage_dtype)

  out = [jax.device_put(fill(jnp.uint32(seed + i)), jax.devices()[0])
         for i in range(1 if layered else layers)]
  return out[0] if layered else out


# -- the prefill process ----------------------------------------------------------------------
def prefill_main(transport: str, smoke: bool):
  shape = Shape(smoke)
  server = remote.start_server(transport=transport)
  offers, caches = [], None
  for line in sys.stdin:
    job = json.loads(line)
    if job["op"] == "offer":
      spec = shape.spec(job["fmt"])
      pages = -(-job["tokens"] // shape.block)
      count = job["requests"]
      caches = filled_layers(spec, count * pages, shape.layers, job["layered"], job["seed"])
      jax.block_until_ready(caches)
      tokens, offer_ms = [], []
      for r in range(count):
        ids = np.arange(r * pages, (r + 1) * pages, dtype=np.int32)
        t0 = time.perf_counter()
        offer = remote.offer_request_layers(server, [caches], ids, spec=spec, ttl_s=600)
        offer_ms.append((time.perf_counter() - t0) * 1e3)
        offers.append(offer)
        tokens.append(offer.token)
      reply = {"address": server.address(), "tokens": tokens,
               "offer_ms": statistics.median(offer_ms), "request_bytes": offers[-1].nbytes}
    else:   # "release"
      for o in offers:
        o.release()
      offers, caches = [], None
      reply = {"released": True}
    print(json.dumps(reply), flush=True)


class Prefill:
  def __init__(self, transport: str, smoke: bool):
    args = [sys.executable, os.path.abspath(__file__), "--role", "prefill", "--transport",
            transport] + (["--smoke"] if smoke else [])
    # The platform allocator gives the memory XLA frees (the fill's temporaries) back to the
    # driver, where the offers' shareable slabs are allocated; XLA's default pool keeps it.
    env = dict(os.environ, XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env)

  def ask(self, **job):
    self.proc.stdin.write(json.dumps(job) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"the prefill process exited with {self.proc.wait()}")
    return json.loads(line)

  def close(self):
    try:
      self.proc.stdin.close()
      self.proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
      self.proc.kill()
      self.proc.wait()


# -- this (decode) process --------------------------------------------------------------------
def pull(server, address, caches, spec, pages, slot, token):
  dst = np.arange(slot * pages, (slot + 1) * pages, dtype=np.int32)
  (out,), _ = remote.pull_request_layers(server, address, [caches], spec, dst, token=token,
                                         remote_tp_size=1,
                                         total_num_kv_heads=spec.num_kv_heads, timeout_s=300)
  return out


def copy_gb_s(nbytes: int) -> float:
  """This device's copy of ``nbytes`` (an XLA elementwise pass over 32-bit words), GB/s."""
  x = jax.random.bits(jax.random.PRNGKey(0), (nbytes // 4,), jnp.uint32)
  ms = common.time_jax(jax.jit(lambda a: a ^ jnp.uint32(1)), x, reps=5, inner=5)
  return nbytes / (ms * 1e-3) / 1e9


def receive_gb_s(spec, nbytes: int) -> float:
  """The receive's device work alone: one request's bytes as one-layer page rows (uint8, as
  pulled) stored by ``kvjax.pages.store_pages`` (the op a pull lands pages with) into a
  cache of twice as many blocks, at scattered block ids; GB/s of the request's bytes."""
  page = spec.page_bytes
  n = nbytes // page
  table = jax.random.bits(jax.random.PRNGKey(1), (2 * n, page), jnp.uint8)
  table = jax.lax.bitcast_convert_type(table.reshape(2 * n, -1, spec.itemsize),
                                       spec.storage_dtype) if spec.itemsize > 1 else table
  rows = jax.random.bits(jax.random.PRNGKey(2), (n, page), jnp.uint8)
  ids = jnp.asarray(np.random.default_rng(0).permutation(2 * n)[:n].astype(np.int32))
  store = jax.jit(pages.store_pages, donate_argnums=0)
  box = [table]

  def step(r, i):
    box[0] = store(box[0], r, i)
    return box[0]
  ms = common.time_jax(step, rows, ids, reps=5, inner=5)
  return nbytes / (ms * 1e-3) / 1e9


class FetchClock:
  """The pull side of a server, timing its fetches (control round trip, mapping, views)."""

  def __init__(self, server):
    self.server, self.seconds = server, 0.0

  def fetch(self, *args):
    t0 = time.perf_counter()
    try:
      return self.server.fetch(*args)
    finally:
      self.seconds += time.perf_counter() - t0


def pull_round(server, prefill, shape, spec, caches, fmt, layered, requests, seed):
  """Offer ``requests`` requests, pull them all into ``caches``; (caches, seconds, fetch
  seconds, whether every pull wrote the caches in place, the offer reply)."""
  pages = -(-shape.tokens // shape.block)
  got = prefill.ask(op="offer", fmt=fmt, layered=layered, tokens=shape.tokens, requests=requests,
                    seed=seed)
  clock, in_place = FetchClock(server), True
  jax.block_until_ready(caches)
  t0 = time.perf_counter()
  for r in range(requests):
    before = caches if layered else caches[0]
    caches = pull(clock, got["address"], caches, spec, pages, r, got["tokens"][r])
    in_place &= before.is_deleted()
  seconds = time.perf_counter() - t0
  prefill.ask(op="release")
  return caches, seconds, clock.seconds, in_place, got


def batched_round(server, prefill, shape, spec, caches, fmt, layered, requests, seed):
  """Offer ``requests`` requests, pull them all in one round (``pull_requests_layers``);
  (caches, seconds)."""
  pages = -(-shape.tokens // shape.block)
  got = prefill.ask(op="offer", fmt=fmt, layered=layered, tokens=shape.tokens, requests=requests,
                    seed=seed)
  dsts = [np.arange(r * pages, (r + 1) * pages, dtype=np.int32) for r in range(requests)]
  jax.block_until_ready(caches)
  t0 = time.perf_counter()
  (caches,), _ = remote.pull_requests_layers(server, got["address"], [caches], spec, dsts,
                                             tokens=got["tokens"], remote_tp_size=1,
                                             total_num_kv_heads=spec.num_kv_heads,
                                             timeout_s=300)
  seconds = time.perf_counter() - t0
  prefill.ask(op="release")
  return caches, seconds


def large(server, prefill, shape, transport, fmt, layered, requests):
  """Two rounds of ``requests`` pulls: the first maps the prefill side's memory as it comes
  (cold), the second reads memory already mapped (warm: what a serving decode process sees)."""
  spec = shape.spec(fmt)
  pages = -(-shape.tokens // shape.block)
  caches = filled_layers(spec, requests * pages, shape.layers, layered, 7)
  caches, cold, _, _, _ = pull_round(server, prefill, shape, spec, caches, fmt, layered,
                                     requests, 1)
  caches, warm, fetch_s, in_place, got = pull_round(server, prefill, shape, spec, caches, fmt,
                                                    layered, requests, 2)
  batched = None
  if requests > 1:      # all in one round: a first batch compiles, the second is timed
    for seed in (3, 4):
      caches, batched = batched_round(server, prefill, shape, spec, caches, fmt, layered,
                                      requests, seed)
  del caches
  nbytes = got["request_bytes"]
  total = requests * nbytes
  row = dict(transport=transport, fmt=fmt, form="layered" if layered else "per-layer",
             requests=requests, request_mib=nbytes / 2**20, gb_s=total / warm / 1e9,
             cold_gb_s=total / cold / 1e9, fetch_share=fetch_s / warm, in_place=in_place,
             batched_gb_s=None if batched is None else total / batched / 1e9,
             offer_ms=got["offer_ms"], copy_gb_s=copy_gb_s(nbytes),
             receive_gb_s=receive_gb_s(spec, nbytes),
             peak_gib=common.peak_device_gib())
  row["of_copy"] = row["gb_s"] / row["copy_gb_s"]
  log(f"{transport:8s} {fmt:4s} {row['form']:9s} {requests:3d} x {nbytes / 2**20:6.1f} MiB: "
      f"{row['gb_s']:7.2f} GB/s = {row['of_copy']:6.1%} of the device copy "
      f"({row['copy_gb_s']:.0f} GB/s); "
      + ("" if batched is None else f"all in one round {row['batched_gb_s']:.1f} GB/s = "
         f"{row['batched_gb_s'] / row['copy_gb_s']:.1%}; ") +
      f"the receive's device work alone "
      f"{row['receive_gb_s']:.0f} GB/s; first round {row['cold_gb_s']:.2f} GB/s; fetch "
      f"{row['fetch_share']:.0%} of a pull; in place {in_place}; offer {row['offer_ms']:.2f} ms; "
      f"peak {row['peak_gib']:.1f} GiB")
  return row


def small(server, prefill, shape, transport, fmt, layered):
  spec = shape.spec(fmt)
  caches = filled_layers(spec, SMALL_PULLS, shape.layers, layered, 8)
  for round_ in range(2):    # the first compiles and maps; the second is timed
    got = prefill.ask(op="offer", fmt=fmt, layered=layered, tokens=shape.block,
                      requests=SMALL_PULLS, seed=99)
    ms = []
    for r in range(SMALL_PULLS):
      t0 = time.perf_counter()
      caches = pull(server, got["address"], caches, spec, 1, r, got["tokens"][r])
      ms.append((time.perf_counter() - t0) * 1e3)
    prefill.ask(op="release")
  ms = sorted(ms)
  row = dict(transport=transport, fmt=fmt, form="layered" if layered else "per-layer",
             request_kib=got["request_bytes"] / 1024, median_ms=statistics.median(ms),
             p90_ms=ms[int(0.9 * (len(ms) - 1))], offer_ms=got["offer_ms"])
  log(f"{transport:8s} {fmt:4s} {row['form']:9s} one page x {shape.layers} layers "
      f"({row['request_kib']:.0f} KiB): median {row['median_ms']:.3f} ms, "
      f"p90 {row['p90_ms']:.3f} ms; offer {row['offer_ms']:.2f} ms")
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
  ap.add_argument("--transport", default="socket", help="(prefill role) its transport")
  ap.add_argument("--transports", default=None, help="comma list (default: cuda_ipc,socket on "
                  "a GPU, socket on CPU)")
  ap.add_argument("--requests", default="1,8,64", help="cuda_ipc request counts")
  ap.add_argument("--socket-requests", default="1,8", help="socket request counts")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  if args.role == "prefill":
    return prefill_main(args.transport, args.smoke)
  if args.smoke:
    common.announce_smoke()
  shape = Shape(args.smoke)
  gpu = jax.devices()[0].platform == "gpu"
  transports = (args.transports or ("cuda_ipc,socket" if gpu else "socket")).split(",")
  counts = {"cuda_ipc": args.requests, "socket": args.socket_requests}
  rows = {"large": [], "small": []}
  for transport in transports:
    server = remote.start_server(transport=transport)
    prefill = Prefill(transport, args.smoke)
    try:
      for fmt in FORMATS:
        for layered in (False, True):
          rows["small"].append(small(server, prefill, shape, transport, fmt, layered))
      for n in ([1] if args.smoke else [int(x) for x in counts[transport].split(",")]):
        for fmt in FORMATS:
          for layered in (False, True):
            try:
              rows["large"].append(large(server, prefill, shape, transport, fmt, layered, n))
            except Exception as e:  # noqa: BLE001 - reported, and the next case runs
              log(f"{transport} {fmt} {'layered' if layered else 'per-layer'} {n} requests: "
                  f"{common.first_lines(e)}")
              prefill.close()
              prefill = Prefill(transport, args.smoke)
    finally:
      prefill.close()
  result = dict(rows, device=common.device_name(), versions=common.versions(),
                date=common.now_utc(), command=common.command_line())
  path = common.output_path(args.json, "bench_transfer.json")
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
  return None


if __name__ == "__main__":
  main()
