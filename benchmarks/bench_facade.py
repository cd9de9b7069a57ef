"""Per-layer cost of kvjax's torch facade against the direct JAX call and vLLM's Triton kernel.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_facade.py [--smoke] [--json PATH]

A decode step of ``L`` layers, each layer with its own cache tensor, run back to back with
one sync at the end (bf16, Hq=32, H=8, D=128, block 16, NHD), in two regimes: 8 sequences of
512 tokens (host-bound: the kernels are short) and 64 sequences of 4096 tokens (GPU-bound).
Per layer, medians over repeats:

- ``vllm``: vLLM's ``unified_attention`` Triton kernel launched from torch on the same cache
  bytes (only where ``vllm_peer.py`` finds vLLM's kernels: a CUDA machine);
- ``facade``: ``PagedAttentionBackend.forward`` with torch tensors, as a user gets it: on a
  Hopper GPU the Mosaic GPU decode kernel launched on torch's stream (the path it took is
  printed), elsewhere through JAX;
- ``captured`` / ``vllm captured``: the facade's step and vLLM's kernels captured in one CUDA
  graph each (``torch.cuda.graph``), per layer of a replay (CUDA, launch path only);
- ``facade via JAX``: the facade with ``direct_launch=False`` (output donated);
- ``direct``: the jitted kvjax op of the JAX path called from JAX with JAX arrays;
- ``floor``: the same loop doing only the crossing work a torch caller cannot avoid, with no
  facade logic (:meth:`Step.floor_fn`: per layer one CUDA event, one fresh DLPack import of
  the query, the facade's jitted function, the stream-ordered export of the result);
  via JAX − floor is the facade's own logic on that path;
- ``facade host`` / ``floor host`` / ``direct host``: host time to issue one call (the loop
  without its final sync).

A second table times the floor's pieces one by one inside that loop (host µs per call,
medians): event, import, the jitted call, export. On the CPU there are no streams: the
event is a no-op and the export is the host wait for the result (so it holds the compute).

``--smoke`` runs tiny shapes on the CPU in well under a minute: it checks that the script runs
and that the facade's and the floor's results equal the direct call's; its timings mean
nothing (on the CPU the facade waits for each result to copy it into ``output``).

``--host`` measures the facade's own host work per call, CPU tensors, the host-bound regime's
shapes: ``forward`` and ``do_kv_cache_update`` with kvjax's jitted functions replaced by stubs
that return their (precomputed) result at once, so what remains is the facade: checks, imports,
metadata, the copy into ``output`` (and, on CPU, of the written pages back into the cache).
It imports ``torch_bridge`` from ``PYTHONPATH`` first, so one copy of this script measures
another checkout (``PYTHONPATH=/other/checkout python3 benchmarks/bench_facade.py --host``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(len(sys.path) if os.environ.get("PYTHONPATH") else 0,
                os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_bridge as tb  # noqa: E402
from benchmarks import common  # noqa: E402
from torch_bridge import layout as L  # noqa: E402

HQ, H, D, N = 32, 8, 128, 16
REGIMES = [("host-bound", 8, 512), ("GPU-bound", 64, 4096)]
SMOKE = dict(hq=4, h=2, d=32, regimes=[("small", 8, 64), ("large", 16, 256)], layers=4,
             reps=10)
FULL = dict(hq=HQ, h=H, d=D, regimes=REGIMES, layers=16, reps=10)


def _sync(dev):
  if dev.type == "cuda":
    torch.cuda.synchronize(dev)


class Step:
  """One regime's decode step: L caches (torch), per-layer q / output, shared metadata.

  ``layered``: one layered (cross-layer) cache tensor for all L layers instead, each call
  passing it whole with ``layer=i`` (``self.layer_ids``; None per layer otherwise)."""

  def __init__(self, dev, seqs, ctx, layers, hq, h, d, rng, layered=False,
               cache_dtype="auto"):
    self.dev, self.layers = dev, layers
    self.backend = tb.PagedAttentionBackend(hq, h, d, N, cache_dtype, "NHD",
                                            dtype=torch.bfloat16)
    self.jax_backend = tb.PagedAttentionBackend(hq, h, d, N, cache_dtype, "NHD",
                                                dtype=torch.bfloat16, direct_launch=False)
    blocks = -(-ctx // N)
    num_blocks = seqs * blocks + 1
    self.caches = []
    for _ in range(1 if layered else layers):
      c = self.backend.allocate_kv_cache(num_blocks, device=dev,
                                         num_layers=layers if layered else None)
      self._fill(c, num_blocks, layers if layered else None)
      self.caches.append(c)
    if layered:
      self.caches = self.caches * layers
    self.layer_ids = list(range(layers)) if layered else [None] * layers
    table = rng.permutation(num_blocks)[:seqs * blocks].reshape(seqs, blocks).astype(np.int32)
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    self.md = tb.PagedAttentionMetadata(
        as_t(np.arange(seqs + 1, dtype=np.int32)), as_t(np.full(seqs, ctx, np.int32)),
        as_t(table), as_t(table[:, 0] * N), max_query_len=1, max_seq_len=ctx)
    self.qs = [torch.randn(seqs, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    self.outs = [torch.empty_like(q) for q in self.qs]
    spec = self.backend.spec
    token_bytes = int(np.prod(spec.physical_shape(1))) * spec.itemsize / N
    self.kv_gb = layers * seqs * ctx * token_bytes / 1e9

  def _fill(self, cache, num_blocks, layers):
    """Random contents: normal values in a bf16 / f16 cache, else every slot written with
    normal K / V (through the facade: the codec's own bytes and scales)."""
    be = self.jax_backend
    phys = L.physical_tensor(cache, be.spec)
    if phys.dtype in (torch.bfloat16, torch.float16):
      phys.normal_()
      return
    slots = torch.arange(num_blocks * N, device=self.dev)
    shape = (slots.shape[0], be.spec.num_kv_heads, be.spec.head_size)
    for layer in range(layers or 1):
      k, v = (torch.randn(shape, device=self.dev, dtype=torch.bfloat16) for _ in range(2))
      be.do_kv_cache_update(k, v, cache, slots, layer=None if layers is None else layer)

  def facade(self, backend=None):
    fwd, md = (backend or self.backend).forward, self.md
    for q, c, o, i in zip(self.qs, self.caches, self.outs, self.layer_ids):
      fwd(q, c, md, o, layer=i)
    return None

  def facade_jax(self):
    return self.facade(self.jax_backend)

  def captured_fn(self, run):
    """``run`` (a step issuing only torch-stream work) captured in a CUDA graph: its replay.
    None on the CPU, or when the step's path is not the torch launch (JAX's calls do not
    capture)."""
    if self.dev.type != "cuda":
      return None
    run()
    if run == self.facade and self.backend.last_path.startswith("jax"):
      return None
    torch.cuda.synchronize(self.dev)
    graph = torch.cuda.CUDAGraph()
    # thread_local: JAX's runtime threads (this process also runs JAX on the GPU) may touch
    # CUDA while the capture runs; the default mode ("global") would fail the capture then
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
      run()
    return graph.replay

  def direct_fn(self):
    """The facade's own jitted function (the one its calls use), called with JAX arrays that
    were imported once, output donated the same way: the facade's cost is the difference."""
    be, md = self.jax_backend, self.md
    self.facade_jax()                      # compiles, and fills the facade's function cache
    (fn,) = be._attn.values()
    t = self.qs[0].shape[0]
    cx = be._crossing(self.dev)
    qsl, sl, bt = md.jax_arrays(cx, t)
    qj = [jax.numpy.array(cx.fresh(q)) for q in self.qs]
    cj = [tb.from_torch(c, be.spec) for c in self.caches]
    ids = [None if i is None else jax.device_put(jax.numpy.int32(i), cx.jax_device)
           for i in self.layer_ids]
    donate = self.dev.type == "cuda"       # the facade's default output_mode on CUDA
    outs = [jax.numpy.zeros_like(q) for q in qj]

    def run():
      r = None
      for i, (q, c, li) in enumerate(zip(qj, cj, ids)):
        if donate:
          outs[i] = r = fn(q, c, qsl, sl, bt, None, None, None, li, outs[i])
        else:            # CPU: the facade waits for each result (it copies it into output)
          r = fn(q, c, qsl, sl, bt, None, None, None, li).block_until_ready()
      return r
    return run

  def _floor_parts(self):
    """What the floor loop uses, all prepared by the facade itself: the crossing, its jitted
    function, the step's kept metadata arrays, the kept cache arrays, the layer scalars."""
    be, md = self.jax_backend, self.md
    self.facade_jax()                      # compiles, and fills the facade's caches
    (fn,) = be._attn.values()
    cx = be._crossing(self.dev)
    meta = md.jax_arrays(cx, self.qs[0].shape[0])
    caches = [be._cache_array(cx, be._cache(c, i)) for c, i in zip(self.caches, self.layer_ids)]
    ids = [be._layer_array(cx, i) for i in self.layer_ids]
    donate = self.dev.type == "cuda"       # the facade's default output_mode on CUDA
    outs = [jax.numpy.zeros(q.shape, be.spec.dtype, device=cx.jax_device) for q in self.qs]
    return fn, cx, meta, caches, ids, donate, outs

  def floor_fn(self):
    """The irreducible crossing work of a facade call around the same jitted function, with
    no facade logic. Per layer: the fence (one event on torch's stream that JAX's
    external-ready stream waits on), one fresh import of the query (the import defined after
    the fence, which orders the computation after torch's queued work), the call (output
    donated on CUDA, as the facade does), the export of the result to torch's stream (CPU: a
    host wait)."""
    fn, cx, (qsl, sl, bt), caches, ids, donate, outs = self._floor_parts()

    def run():
      r = None
      for i, (q, c, li) in enumerate(zip(self.qs, caches, ids)):
        stream = cx.fence()
        qj = cx.fresh(q)
        if donate:
          outs[i] = r = fn(qj, c, qsl, sl, bt, None, None, None, li, outs[i])
        else:
          r = fn(qj, c, qsl, sl, bt, None, None, None, li)
        cx.publish(r, stream)
      return r
    return run

  def pieces_us(self, reps):
    """Host µs per call of each piece of the floor loop, each timed alone inside the loop
    (so each sees what it sees in a facade call: the export a result still being computed),
    medians over ``reps`` steps of L layers: event (``fence``: torch's current stream read,
    one event recorded on it and waited on), import (``fresh`` of q), call (the jitted
    function), export (``publish`` on that stream)."""
    fn, cx, (qsl, sl, bt), caches, ids, donate, outs = self._floor_parts()
    clock = time.perf_counter
    spent = {"event": [], "import": [], "call": [], "export": []}
    for rep in range(reps + 1):
      _sync(self.dev)
      for i, (q, c, li) in enumerate(zip(self.qs, caches, ids)):
        t0 = clock()
        stream = cx.fence()
        t1 = clock()
        qj = cx.fresh(q)
        t2 = clock()
        if donate:
          outs[i] = r = fn(qj, c, qsl, sl, bt, None, None, None, li, outs[i])
        else:
          r = fn(qj, c, qsl, sl, bt, None, None, None, li)
        t3 = clock()
        cx.publish(r, stream)
        t4 = clock()
        if rep:                            # the first step warms up
          for name, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            spent[name].append(dt * 1e6)
      jax.block_until_ready(r)
    _sync(self.dev)
    return {f"{name}_us": statistics.median(v) for name, v in spent.items()}

  def vllm_fn(self):
    from benchmarks import vllm_peer
    if not (self.dev.type == "cuda" and vllm_peer.available()):
      return None
    md, be = self.md, self.backend
    runs = [vllm_peer.attention(be.spec, c, q, cu_seqlens_q=md.query_start_loc,
                                seqused_k=md.seq_lens, block_table=md.block_table,
                                max_seqlen_q=1, max_seqlen_k=md.max_seq_len, scale=be.scale)
            for c, q in zip(self.caches, self.qs)]

    def run():
      for r in runs:
        r()
    return run


def per_layer_us(run, wait, layers, reps):
  """(median wall per layer, median host time per layer) over ``reps`` back-to-back steps."""
  run()
  wait(run())
  walls, hosts = [], []
  for _ in range(reps):
    wait(None)
    t0 = time.perf_counter()
    r = run()
    t1 = time.perf_counter()
    wait(r)
    t2 = time.perf_counter()
    hosts.append((t1 - t0) / layers * 1e6)
    walls.append((t2 - t0) / layers * 1e6)
  return statistics.median(walls), statistics.median(hosts)


def bench_regime(name, seqs, ctx, cfg, dev, rng):
  step = Step(dev, seqs, ctx, cfg["layers"], cfg["hq"], cfg["h"], cfg["d"], rng,
              cfg.get("layered", False), cfg["cache_dtype"])
  torch_wait = lambda r: _sync(dev)

  def jax_wait(r):
    _sync(dev)
    if r is not None:
      jax.block_until_ready(r)

  row = {"regime": name + (", layered" if cfg.get("layered") else ""), "seqs": seqs, "ctx": ctx,
         "layers": step.layers,
         "kv_gb": round(step.kv_gb, 3)}
  direct = step.direct_fn()
  row["direct_us"], row["direct_host_us"] = per_layer_us(direct, jax_wait, step.layers,
                                                         cfg["reps"])
  row["facade_us"], row["facade_host_us"] = per_layer_us(step.facade, torch_wait, step.layers,
                                                         cfg["reps"])
  row["path"] = step.backend.last_path
  facade_out = step.outs[-1].float().cpu()
  row["facade_jax_us"], row["facade_jax_host_us"] = per_layer_us(
      step.facade_jax, torch_wait, step.layers, cfg["reps"])
  captured = step.captured_fn(step.facade)
  row["captured_us"] = None if captured is None else per_layer_us(
      captured, torch_wait, step.layers, cfg["reps"])[0]
  floor = step.floor_fn()
  row["floor_us"], row["floor_host_us"] = per_layer_us(floor, jax_wait, step.layers,
                                                       cfg["reps"])
  row.update(step.pieces_us(cfg["reps"]))
  cx = step.backend._crossing(dev)       # True, True: jaxlib's raw DLPack import and export ran
  row["raw_import"], row["raw_export"] = cx._fast_checked, cx._export_checked
  vllm = None if cfg.get("layered") else step.vllm_fn()
  row["vllm_us"] = row["vllm_captured_us"] = None
  if vllm is not None:
    row["vllm_us"], row["vllm_host_us"] = per_layer_us(vllm, torch_wait, step.layers,
                                                       cfg["reps"])
    replay = step.captured_fn(vllm)
    row["vllm_captured_us"] = per_layer_us(replay, torch_wait, step.layers, cfg["reps"])[0]
  row["added_us"] = row["facade_jax_us"] - row["direct_us"]
  row["floor_added_us"] = row["floor_us"] - row["direct_us"]
  row["over_floor_us"] = row["facade_jax_us"] - row["floor_us"]
  # the facade's result is the direct call's within bf16 rounding (the launch path runs
  # another kernel where it is taken); the floor loop's equals it (same jitted function)
  step.facade_jax()
  out = step.outs[-1].float().cpu()
  ref = torch.from_dlpack(direct()).float().cpu()
  row["max_abs_diff"] = float((facade_out - ref).abs().max())
  row["jax_max_abs_diff"] = float((out - ref).abs().max())
  row["floor_max_abs_diff"] = float((torch.from_dlpack(floor()).float().cpu() - ref).abs().max())
  _sync(dev)
  step.backend.clear_cached_views()      # release every imported view before the next regime
  step.jax_backend.clear_cached_views()
  return row


def table(rows):
  f = lambda v: "-" if v is None else f"{v:.1f}"
  lines = ["| per layer (µs) | vLLM Triton from torch | kvjax facade | facade host | "
           "vLLM captured | kvjax captured | facade via JAX | direct JAX | "
           "via JAX − direct | floor − direct |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['regime']}: {r['seqs']} seqs x {r['ctx']}, {r['layers']} layers | "
                 f"{f(r['vllm_us'])} | {f(r['facade_us'])} | {f(r['facade_host_us'])} | "
                 f"{f(r['vllm_captured_us'])} | {f(r['captured_us'])} | "
                 f"{f(r['facade_jax_us'])} | {f(r['direct_us'])} | {f(r['added_us'])} | "
                 f"{f(r['floor_added_us'])} |")
  lines += ["", "| regime | the facade's path | max abs diff vs direct JAX |", "|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['regime']} | {r['path']} | {r['max_abs_diff']:.3g} |")
  lines += ["", "| floor pieces, host µs per call (medians) | event (record + wait) | "
            "fresh import of q | jitted call | export of the result | event + import + export |",
            "|---|---|---|---|---|---|"]
  for r in rows:
    crossing = r["event_us"] + r["import_us"] + r["export_us"]
    lines.append(f"| {r['regime']} | {f(r['event_us'])} | {f(r['import_us'])} | "
                 f"{f(r['call_us'])} | {f(r['export_us'])} | {f(crossing)} |")
  return "\n".join(lines)


def _stub(factory):
  """``factory`` (jitted.attention_fn / write_fn) whose functions return the result of their
  first call, computed once by the real function, at once."""
  def make(*args, **kwargs):
    real, memo = factory(*args, **kwargs), []

    def fn(*call_args):
      if not memo:
        memo.append(jax.block_until_ready(real(*call_args)))
      return memo[0]
    return fn
  return make


def host_cost(cfg, rng, reps):
  """Median host µs per facade call (forward, do_kv_cache_update) with stubbed jitted
  functions, CPU tensors, the host-bound regime's shapes, each layer its own cache."""
  from torch_bridge import jitted
  _, seqs, ctx = cfg["regimes"][0]
  dev = torch.device("cpu")
  real = jitted.attention_fn, jitted.write_fn
  jitted.attention_fn, jitted.write_fn = _stub(real[0]), _stub(real[1])
  try:
    step = Step(dev, seqs, ctx, cfg["layers"], cfg["hq"], cfg["h"], cfg["d"], rng,
                cfg.get("layered", False))
    be, md = step.backend, step.md
    keys = [torch.randn(seqs, cfg["h"], cfg["d"], dtype=torch.bfloat16) for _ in step.caches]
    slots = md.slot_mapping

    lid = step.layer_ids if cfg.get("layered") else None

    def forward():
      for q, c, o, i in zip(step.qs, step.caches, step.outs, step.layer_ids):
        be.forward(q, c, md, o, **({} if lid is None else {"layer": i}))

    def update():
      for k, c, i in zip(keys, step.caches, step.layer_ids):
        be.do_kv_cache_update(k, k, c, slots, **({} if lid is None else {"layer": i}))

    row = {"regime": f"{seqs} seqs x {ctx}", "layers": step.layers}
    for name, run in (("forward", forward), ("update", update)):
      run()
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / step.layers * 1e6)
      row[f"{name}_host_us"] = statistics.median(times)
      row[f"{name}_host_min_us"] = min(times)
    return row
  finally:
    jitted.attention_fn, jitted.write_fn = real


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (< 60 s)")
  ap.add_argument("--json", default=None, help="also write the rows to this JSON file "
                  "(default $OUT/facade.json when $OUT is set)")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--layered", action="store_true",
                  help="one layered (cross-layer) cache for all layers, passed with layer=i")
  ap.add_argument("--cache-dtype", default="auto",
                  help="the caches' format (a kvjax cache_dtype; default: bf16)")
  ap.add_argument("--host", action="store_true",
                  help="the facade's own host work per call (CPU tensors, stubbed JAX calls)")
  args = ap.parse_args()
  if args.smoke:
    common.announce_smoke("cpu")
  cfg = dict(SMOKE if args.smoke else FULL)
  if args.layers:
    cfg["layers"] = args.layers
  cfg["layered"] = args.layered
  cfg["cache_dtype"] = args.cache_dtype
  if args.host:
    row = host_cost(cfg, np.random.default_rng(0), cfg["reps"] * 20)
    print(f"jax {jax.__version__}, torch {torch.__version__}, torch_bridge from "
          f"{os.path.dirname(tb.__file__)}")
    print(row)
    print("| per call (µs, CPU host) | forward median | forward min | update median | "
          "update min |\n|---|---|---|---|---|")
    print(f"| {row['regime']}, {row['layers']} layers | {row['forward_host_us']:.1f} | "
          f"{row['forward_host_min_us']:.1f} | {row['update_host_us']:.1f} | "
          f"{row['update_host_min_us']:.1f} |")
    return
  dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
  t0 = time.time()
  print(f"jax {jax.__version__}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; "
        f"Hq={cfg['hq']} H={cfg['h']} D={cfg['d']} bf16 decode, cache_dtype "
        f"{args.cache_dtype!r}, float32 matmul precision "
        f"{torch.get_float32_matmul_precision()!r}")
  rng = np.random.default_rng(0)
  rows = []
  for name, seqs, ctx in cfg["regimes"]:
    rows.append(bench_regime(name, seqs, ctx, cfg, dev, rng))
    print(rows[-1], flush=True)
  print(f"\n== facade per layer, back to back, one sync ({time.time() - t0:.0f} s) ==")
  print(table(rows))
  path = common.output_path(args.json, "facade.json")
  if path:
    with open(path, "w") as f:
      json.dump({"rows": rows, "jax": jax.__version__, "torch": torch.__version__,
                 "device": str(dev), "smoke": args.smoke, "date": common.now_utc()}, f,
                indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  common.exit_after(main)
