"""Disaggregated prefill/decode across two processes, over loopback.

  python examples/disaggregated_transfer.py             # simulated CPU devices, TP=2 -> TP=4
  python examples/disaggregated_transfer.py --one-gpu   # both processes on the first GPU

Without ``--one-gpu`` both processes run on 8 simulated CPU devices and the pages travel over
the socket transport. With it, both run on the first GPU (TP=1 each; the GPU's memory is not
preallocated, so the two share it) and the pages travel over CUDA IPC: the decode side reads
them in place in device memory.

A prefill process (TP=2; TP=1 with ``--one-gpu``) writes two requests' prompt K/V into
head-sharded caches and offers each request's pages of all layers at once
(kvjax.transfer.remote.offer_request_layers). For each request it answers the router with the
server address and one capability token; the router forwards that message to the decode
process (this one, TP=4; TP=1 with ``--one-gpu``), which pulls every layer's pages by that
token, in one pull round, into its own caches at its own block ids (pull_request_layers,
bounded by timeout_s).

- Request 1: the pull succeeds; the decode side tells the prefill side (through the router)
  that it is done, and the prefill side releases the offer at once instead of at its TTL.
- Request 2: the prefill process dies after answering the router. The pull raises
  TimeoutError or PullError, the decode caches stay as they were, and the decode side
  recomputes the request's prefill itself.
Both requests' decode attention is checked against attention over one unsharded cache
written directly. See docs/transfers.md for the trust model.
"""
import os
import sys

ONE_GPU = "--one-gpu" in sys.argv
if ONE_GPU:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # two processes, one GPU
else:
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import kvjax  # noqa: E402
from kvjax import sharding as KS  # noqa: E402
from kvjax.transfer import remote  # noqa: E402

H, HQ, D, N = 4, 16, 64, 16            # KV heads, query heads, head size, block size
P_TP, D_TP = (1, 1) if ONE_GPU else (2, 4)
TRANSPORT = "cuda_ipc" if ONE_GPU else "socket"
LAYERS, BLOCKS = 2, 8
PROMPT = 45                            # tokens: 3 blocks, the last partial
LAYOUT, CACHE_DTYPE = "HND", "fp8_per_token_head"
SRC_BLOCKS, DST_BLOCKS = np.array([5, 0, 3]), np.array([2, 7, 4])
PULL_TIMEOUT_S, OFFER_TTL_S = 5.0, 60.0
SPEC = kvjax.KVCacheSpec(H, D, N, cache_dtype=CACHE_DTYPE, layout=LAYOUT)   # global spec


def slots(block_ids):
  pos = np.arange(PROMPT)
  return jnp.asarray(block_ids[pos // N] * N + pos % N, jnp.int32)


def prompt_kv(request_id, layer):
  """The model's prefill stand-in: a request's K and V of one layer, ``[PROMPT, H, D]`` each."""
  g = np.random.default_rng(1000 * request_id + layer)
  return (jnp.asarray(g.standard_normal((PROMPT, H, D)), jnp.bfloat16),
          jnp.asarray(g.standard_normal((PROMPT, H, D)), jnp.bfloat16))


# -- prefill process --------------------------------------------------------------------------
def prefill_process():
  """Serves the router's lines on stdin: ``{"prefill": id}`` and ``{"done": id}``."""
  signal.alarm(120)   # never outlive the example
  server = remote.start_server(transport=TRANSPORT)   # 127.0.0.1 (socket: allow_remote=True
                                                      # binds beyond this host)
  mesh = Mesh(np.asarray(jax.devices()[:P_TP]), ("tp",))
  offers = {}
  for line in sys.stdin:   # EOF ends the process
    cmd = json.loads(line)
    if "prefill" in cmd:
      request_id, layers = cmd["prefill"], []
      for layer in range(LAYERS):
        cache = SPEC.allocate(BLOCKS, sharding=KS.cache_sharding(mesh, SPEC))
        cache = KS.sharded_write_kv(cache, *prompt_kv(request_id, layer), slots(SRC_BLOCKS),
                                    SPEC, mesh)
        layers.append(KS.rank_caches(cache, SPEC, mesh))
      # One offer of every layer's pages: per prefill rank, its caches of all layers.
      rank_layers = [[layers[l][s] for l in range(LAYERS)] for s in range(P_TP)]
      offer = remote.offer_request_layers(server, rank_layers, SRC_BLOCKS,
                                          spec=KS.shard_spec(SPEC, P_TP), ttl_s=OFFER_TTL_S)
      offers[request_id] = offer
      # The answer to the router: where the pages are and the capability to take them.
      answer = {"request_id": request_id, "address": server.address(), "token": offer.token,
                "num_layers": LAYERS, "remote_tp_size": P_TP, "num_pages": len(SRC_BLOCKS)}
    else:   # the decode side is done with the request: free its pages now, not at the TTL
      offer = offers.pop(cmd["done"], None)
      if offer is not None:
        offer.release()
      answer = {"live_offers": remote.live_offers().count}
    print(json.dumps(answer), flush=True)


# -- decode process (and the router's part) ---------------------------------------------------
def pull_layers(server, msg, rank_spec, devices):
  """Every layer's pages of a request, by its one token in one pull round, into fresh per-rank
  decode caches; per layer, the rank caches (TimeoutError/PullError if the prefill side cannot
  deliver)."""
  rank_layers = [[jax.device_put(rank_spec.allocate(BLOCKS), d) for _ in range(msg["num_layers"])]
                 for d in devices]
  rank_layers, _ = remote.pull_request_layers(
      server, msg["address"], rank_layers, rank_spec, DST_BLOCKS, token=msg["token"],
      remote_tp_size=msg["remote_tp_size"], total_num_kv_heads=H, timeout_s=PULL_TIMEOUT_S)
  return [[rank_layers[r][l] for r in range(len(devices))] for l in range(msg["num_layers"])]


def recompute_prefill(request_id, mesh):
  """Fallback: run the request's prefill on the decode side, into its own block ids."""
  caches = []
  for layer in range(LAYERS):
    cache = SPEC.allocate(BLOCKS, sharding=KS.cache_sharding(mesh, SPEC))
    cache = KS.sharded_write_kv(cache, *prompt_kv(request_id, layer), slots(DST_BLOCKS), SPEC, mesh)
    caches.append(KS.rank_caches(cache, SPEC, mesh))
  return caches


#: Largest difference allowed between the sharded decode's bf16 output and the reference over
#: an unsharded cache: the bytes are equal, but the summation order over keys may differ (one
#: bf16 rounding step of values of magnitude about 1).
ATTENTION_TOL = 2.0 ** -7


def check_attention(request_id, layers, mesh):
  """Decode attention over the sharded decode cache vs one unsharded cache written directly:
  the cache bytes equal, the outputs within :data:`ATTENTION_TOL`."""
  q = jnp.asarray(np.random.default_rng(request_id).standard_normal((1, HQ, D)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.array([0, 1]), seq_lens=jnp.array([PROMPT]),
              block_table=jnp.asarray([DST_BLOCKS]), scale=D ** -0.5)
  worst = 0.0
  for layer, rank_caches in enumerate(layers):
    cache = KS.from_rank_caches(rank_caches, SPEC, mesh)
    out = KS.sharded_unified_attention(q, cache, SPEC, mesh, **meta)
    direct = kvjax.write_kv(SPEC.allocate(BLOCKS), *prompt_kv(request_id, layer),
                            slots(DST_BLOCKS), SPEC)
    ref = kvjax.unified_attention(q, direct, SPEC, impl="reference", **meta)
    worst = max(worst, float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))))
    same = np.array_equal(np.asarray(cache).view(np.uint8), np.asarray(direct).view(np.uint8))
    assert same and worst <= ATTENTION_TOL, (request_id, layer, same, worst)
  return worst


def ask(proc, cmd, timeout_s):
  """Send a JSON line to a child process (unbuffered pipes); its JSON answer, or None if none
  comes within ``timeout_s``."""
  proc.stdin.write(json.dumps(cmd).encode() + b"\n")
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=timeout_s):
      return None
  line = proc.stdout.readline()
  return json.loads(line) if line else None


def main():
  devs = jax.devices()
  mesh = Mesh(np.asarray(devs[:D_TP]), ("tp",))
  rank_spec = KS.shard_spec(SPEC, D_TP)
  server = remote.start_server(transport=TRANSPORT)
  print(f"prefill TP={P_TP} (another process) -> decode TP={D_TP} on {devs[:D_TP]}, "
        f"{TRANSPORT} transport")
  print(f"cache {CACHE_DTYPE} {LAYOUT}, H={H} KV heads, page {rank_spec.page_bytes} B local / "
        f"{KS.shard_spec(SPEC, P_TP).page_bytes} B remote; decode ranks read prefill ranks "
        f"{remote.needed_remote_ranks(D_TP, P_TP, H)}")
  prefill = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--prefill"]
                             + (["--one-gpu"] if ONE_GPU else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
  try:
    for request_id in (1, 2):
      msg = ask(prefill, {"prefill": request_id}, 120)   # the router sends the prompt
      assert msg is not None and msg["request_id"] == request_id, msg
      print(f"request {request_id}: router got address {msg['address']} and one token of "
            f"{len(msg['token'])} hex digits for all {msg['num_layers']} layers (not shown: it is "
            "a capability)")
      if request_id == 2:
        prefill.kill()   # the prefill process dies before the decode side pulls
        prefill.wait(timeout=10)
        print("request 2: prefill process killed before the pull")
      t0 = time.monotonic()
      try:
        layers = pull_layers(server, msg, rank_spec, devs[:D_TP])
        how = f"pulled {LAYERS} layers in one pull round in {time.monotonic() - t0:.2f} s"
        live = ask(prefill, {"done": request_id}, 30)   # via the router
        how += f"; prefill side released them (live offers there now: {live['live_offers']})"
      except (TimeoutError, remote.PullError) as e:
        how = (f"pull failed after {time.monotonic() - t0:.1f} s ({type(e).__name__}); "
               "recomputed the prefill on the decode side")
        layers = recompute_prefill(request_id, mesh)
      worst = check_attention(request_id, layers, mesh)
      print(f"request {request_id}: {how}")
      print(f"request {request_id}: decode cache byte-exact vs direct write, attention max |err| = "
            f"{worst:.3g} (tolerance {ATTENTION_TOL:.3g}): ok")
  finally:
    if prefill.poll() is None:
      prefill.kill()
      prefill.wait(timeout=10)
  print("OK")


if __name__ == "__main__":
  if "--prefill" in sys.argv[1:]:
    prefill_process()
  else:
    main()
