"""Peer processes of tests/test_transfer_ipc.py's GPU tests: prefill and decode on one GPU.

  python tests/_transfer_gpu_peer.py prefill SEED OUT_JSON TRANSPORT NAMES
      NAMES: a comma list of :data:`SCENARIOS` names, one offer each (a name may repeat).
      Writes each request's K/V of every layer into its own GPU caches, offers all layers
      under one token; writes ``{"address", "offers": [{"name", "token"}, ...]}`` to OUT_JSON,
      then waits for a line (or EOF) on stdin and prints ``{"live_offers": count}``.
  python tests/_transfer_gpu_peer.py decode SEED TRANSPORT
      Per job line ``{"name", "address", "token", "timeout_s", "out"}``: pulls the request's
      pages of all layers into poisoned GPU caches at its own block ids, saves the caches'
      bytes (those it passed in when the pull failed) to ``out``, answers
      ``{"outcome", "elapsed_s"}``.
Both run on the first GPU without preallocating its memory, bind only 127.0.0.1, and end by
themselves after LIFETIME_S (SIGALRM) or at EOF on stdin.
"""
import os
import sys

if __name__ == "__main__":
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # two processes share the GPU

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transfer_data as TD  # noqa: E402
from kvjax.transfer import remote  # noqa: E402

LIFETIME_S = 240
LAYERS, TOKENS, HEADS, HEAD_SIZE = 4, 40, 4, 64
SRC_BLOCKS, DST_BLOCKS = [6, 2, 4], [1, 7, 0]
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 9
SCALES = {"nvfp4": dict(k_scale=0.05, v_scale=0.03)}

#: name -> (cache_dtype, layout, prefill caches layered, decode caches layered)
SCENARIOS = {
    "bf16-nhd-layered": ("auto", "NHD", True, True),
    "bf16-hnd": ("auto", "HND", False, False),
    "fp8-nhd": ("fp8", "NHD", False, True),
    "int8-hnd-layered": ("int8_per_token_head", "HND", True, False),
    "fp8th-nhd": ("fp8_per_token_head", "NHD", False, False),
    "int4-hnd": ("int4_per_token_head", "HND", False, False),
    "int4-nhd-layered": ("int4_per_token_head", "NHD", True, True),
    "nvfp4-hnd": ("nvfp4", "HND", False, False),
}


def spec_of(name):
  cache_dtype, layout, _, _ = SCENARIOS[name]
  return TD.rank_spec(cache_dtype, HEAD_SIZE, layout, HEADS, 1)


def layers_kv(name, seed):
  return [TD.request_kv(seed + 7 * layer, TOKENS, HEADS, HEAD_SIZE) for layer in range(LAYERS)]


def stack(layers, spec):
  return jnp.stack(layers, axis=spec.layer_axis)


def prefill_caches(name, seed):
  cache_dtype, _, layered, _ = SCENARIOS[name]
  spec = spec_of(name)
  dev = jax.devices()[0]
  layers = [TD.write_rank_caches(spec, 1, HEADS, k, v, SRC_BLOCKS, PREFILL_BLOCKS, [dev],
                                 **SCALES.get(cache_dtype, {}))[0]
            for k, v in layers_kv(name, seed)]
  return stack(layers, spec) if layered else layers


def poisoned_decode_layers(name, seed):
  """The decode caches before the pull (numpy, per layer)."""
  return [TD.poison_caches(spec_of(name), 1, DECODE_BLOCKS, seed + 100 + layer)[0]
          for layer in range(LAYERS)]


def expected_decode_layers(name, seed):
  """The decode caches (per layer) once the request's pages landed on the poisoned caches."""
  cache_dtype = SCENARIOS[name][0]
  dev = jax.devices()[0]
  return [TD.write_rank_caches(spec_of(name), 1, HEADS, k, v, DST_BLOCKS, DECODE_BLOCKS, [dev],
                               fill=[fill], **SCALES.get(cache_dtype, {}))[0]
          for (k, v), fill in zip(layers_kv(name, seed), poisoned_decode_layers(name, seed))]


def as_layers_bytes(caches, name):
  """Per-layer bytes of a decode rank's caches in either form."""
  spec = spec_of(name)
  if hasattr(caches, "ndim"):
    caches = [jnp.take(caches, layer, axis=spec.layer_axis) for layer in range(LAYERS)]
  return [TD.as_bytes(c) for c in caches]


def prefill(seed, out_json, transport, names):
  server = remote.start_server(transport=transport)
  offers = []
  for name in names.split(","):
    src = prefill_caches(name, seed)
    offers.append((name, remote.offer_request_layers(server, [src], SRC_BLOCKS,
                                                     spec=spec_of(name), ttl_s=120)))
  TD.write_json_atomic(out_json, {"address": server.address(), "offers": [
      {"name": name, "token": o.token} for name, o in offers]})
  sys.stdin.readline()
  TD.reply({"live_offers": remote.live_offers().count})


def decode(seed, transport):
  server = remote.start_server(transport=transport)
  dev = jax.devices()[0]
  for line in sys.stdin:
    job = json.loads(line)
    name = job["name"]
    spec = spec_of(name)
    layers = [jax.device_put(x, dev) for x in poisoned_decode_layers(name, seed)]
    caches = stack(layers, spec) if SCENARIOS[name][3] else layers
    t0 = time.monotonic()
    outcome = "ok"
    try:
      (caches,), _ = remote.pull_request_layers(server, job["address"], [caches], spec,
                                                DST_BLOCKS, token=job["token"], remote_tp_size=1,
                                                total_num_kv_heads=HEADS,
                                                timeout_s=job["timeout_s"])
    except (TimeoutError, remote.PullError) as e:
      outcome = type(e).__name__
    elapsed = time.monotonic() - t0
    np.savez(job["out"], *as_layers_bytes(caches, name))
    TD.reply({"outcome": outcome, "elapsed_s": elapsed})


if __name__ == "__main__":
  signal.alarm(LIFETIME_S)
  role, seed = sys.argv[1], int(sys.argv[2])
  if role == "prefill":
    prefill(seed, sys.argv[3], sys.argv[4], sys.argv[5])
  elif role == "decode":
    decode(seed, sys.argv[3])
  else:
    raise SystemExit(f"unknown role {role!r}")
