"""Peer processes of tests/test_transfer_remote.py: prefill, decode, and a thief.

  python tests/_transfer_peer.py prefill SEED OUT_JSON OFFERS
      OFFERS is a comma list of ``scenario_id:ttl_s``. Writes each offered scenario's
      request into P per-rank caches and offers the pages the decode TP group needs, in
      order; writes ``{"address", "offers": [{"request_id", "token"}, ...]}`` to OUT_JSON
      (the router's message), then waits for a line (or EOF) on stdin and prints
      ``{"live_offers": count}``.
  python tests/_transfer_peer.py decode SEED
      Serves jobs, one JSON line each on stdin: ``{"request_id", "address", "token",
      "timeout_s", "out"}``. Pulls the scenario's pages into D poisoned per-rank caches at
      its own block ids and saves the caches' bytes to ``out`` (the caches it passed in when
      the pull failed); answers one JSON line ``{"outcome", "elapsed_s", "pulled"}``.
  python tests/_transfer_peer.py thief SEED
      Knows the model and, per job line ``{"address", "wait_s"}``, only the server address:
      pulls ids derivable from request ids and random guesses, waits ``wait_s``, answers
      ``{"attempts", "stolen"}`` (pulls that delivered bytes).
Every peer runs on 8 simulated CPU devices, binds only 127.0.0.1, and ends by itself after
LIFETIME_S (SIGALRM) or at EOF on stdin.
"""
import os
import sys

if __name__ == "__main__":  # as a process: 8 CPU devices (imported by the test: its setup)
  from xla_cpu import with_fast_compiles
  os.environ["XLA_FLAGS"] = with_fast_compiles("--xla_force_host_platform_device_count=8")
  os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transfer_data as TD  # noqa: E402
from kvjax.transfer import remote, topology  # noqa: E402

LIFETIME_S = 150
NUM_TOKENS = 40
SRC_BLOCKS, DST_BLOCKS = [6, 2, 4], [1, 7, 0]
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 9


class Scenario:
  def __init__(self, request_id, fmt, layout, total_heads, p, d):
    self.request_id, self.fmt, self.layout = request_id, fmt, layout
    self.total_heads, self.p, self.d = total_heads, p, d
    self.cache_dtype, self.head_size = TD.FORMATS[fmt]
    self.scales = dict(k_scale=0.05, v_scale=0.03) if fmt == "nvfp4" else {}

  def specs(self):
    args = (self.cache_dtype, self.head_size, self.layout, self.total_heads)
    return TD.rank_spec(*args, self.p), TD.rank_spec(*args, self.d)

  def kv(self, seed):
    return TD.request_kv(seed + self.request_id, NUM_TOKENS, self.total_heads, self.head_size)

  def poison(self, seed):
    _, dspec = self.specs()
    return TD.poison_caches(dspec, self.d, DECODE_BLOCKS, seed + 100 + self.request_id)


SCENARIOS = {sc.request_id: sc for sc in [
    Scenario(1, "bf16", "HND", 4, 4, 2),                 # P > D
    Scenario(2, "nvfp4", "HND", 4, 1, 2),                # P < D, K and V head slices
    Scenario(3, "fp8_per_token_head", "NHD", 4, 2, 4),   # NHD: permute on receive
    Scenario(4, "bf16", "HND", 2, 8, 1),                 # P > H: GQA de-duplicated ranks
    Scenario(5, "bf16", "HND", 2, 2, 1),                 # small: the failure tests
]}


def prefill(seed, out_json, offers_arg):
  server = remote.start_server()
  offers = []
  for item in offers_arg.split(","):
    request_id, ttl_s = item.split(":")
    sc = SCENARIOS[int(request_id)]
    pspec, _ = sc.specs()
    k, v = sc.kv(seed)
    caches = TD.write_rank_caches(pspec, sc.p, sc.total_heads, k, v, SRC_BLOCKS, PREFILL_BLOCKS,
                                  jax.devices()[:sc.p], **sc.scales)
    ranks = remote.needed_remote_ranks(sc.d, sc.p, sc.total_heads)
    offers.append((sc.request_id, remote.offer_request(server, caches, SRC_BLOCKS, ranks=ranks,
                                                        ttl_s=float(ttl_s))))
  TD.write_json_atomic(out_json, {"address": server.address(), "offers": [
      {"request_id": rid, "token": o.token} for rid, o in offers]})
  sys.stdin.readline()   # the test says when the decode side is done (or closes stdin)
  TD.reply({"live_offers": remote.live_offers().count})


def decode(seed):
  server = remote.start_server()
  devs = jax.devices()
  for line in sys.stdin:
    job = json.loads(line)
    sc = SCENARIOS[job["request_id"]]
    _, dspec = sc.specs()
    caches = [jax.device_put(x, devs[(sc.p + r) % 8]) for r, x in enumerate(sc.poison(seed))]
    t0 = time.monotonic()
    pulled, outcome = [], "ok"
    try:
      caches, pulled = remote.pull_request(server, job["address"], caches, dspec, DST_BLOCKS,
                                           token=job["token"], remote_tp_size=sc.p,
                                           total_num_kv_heads=sc.total_heads,
                                           timeout_s=job["timeout_s"])
    except (TimeoutError, remote.PullError) as e:
      outcome = type(e).__name__
    elapsed = time.monotonic() - t0
    np.savez(job["out"], **{f"r{r}": TD.as_bytes(c) for r, c in enumerate(caches)})
    TD.reply({"outcome": outcome, "elapsed_s": elapsed, "pulled": list(pulled)})


def thief(seed):
  """Pull what the server address alone reveals: ids made of request ids, and guesses."""
  del seed
  server = remote.start_server()
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for line in sys.stdin:
    job = json.loads(line)
    conn = server.connect(job["address"])
    attempts = []
    for sc in SCENARIOS.values():
      _, dspec = sc.specs()
      page_bytes = topology.remote_spec(dspec, sc.p, sc.total_heads).page_bytes
      pages = jax.ShapeDtypeStruct((len(SRC_BLOCKS), page_bytes), jnp.uint8, sharding=dev)
      ids = [sc.request_id * 1024 + s for s in range(sc.p)] + [sc.request_id]
      ids += [secrets.randbits(64) for _ in range(4)]
      attempts += [conn.pull(i, [pages])[0] for i in ids]
    deadline = time.monotonic() + job["wait_s"]
    while time.monotonic() < deadline and not all(a.is_ready() for a in attempts):
      time.sleep(0.02)
    stolen = 0
    for a in attempts:
      if a.is_ready():
        try:
          a.block_until_ready()
          stolen += 1
        except Exception:  # an error instead of bytes
          pass
    conn._poison_connection()
    TD.reply({"attempts": len(attempts), "stolen": stolen})


if __name__ == "__main__":
  signal.alarm(LIFETIME_S)   # a peer never outlives a stuck test
  role, seed = sys.argv[1], int(sys.argv[2])
  if role == "prefill":
    prefill(seed, sys.argv[3], sys.argv[4])
  elif role == "decode":
    decode(seed)
  elif role == "thief":
    thief(seed)
  else:
    raise SystemExit(f"unknown role {role!r}")
