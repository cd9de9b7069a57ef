"""Peer process of tests/test_transfer_remote.py: the prefill or the decode side.

  python tests/_transfer_peer.py prefill SEED ADDR_FILE
      writes each scenario's request into P per-rank caches, offers the pages the decode
      TP group needs, writes its server address to ADDR_FILE, waits for a line on stdin.
  python tests/_transfer_peer.py decode SEED ADDRESS OUT_NPZ
      pulls every scenario's pages into D per-rank caches (poisoned, own block ids) and
      saves the caches' bytes and the pulled ranks to OUT_NPZ.
Both run on 8 simulated CPU devices and bind only 127.0.0.1.
"""
import os
import sys

if __name__ == "__main__":  # as a process: 8 CPU devices (imported by the test: its setup)
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _transfer_data as TD  # noqa: E402
from kvjax.transfer import remote  # noqa: E402

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


SCENARIOS = [
    Scenario(1, "bf16", "HND", 4, 4, 2),                 # P > D
    Scenario(2, "nvfp4", "HND", 4, 1, 2),                # P < D, K and V head slices
    Scenario(3, "fp8_per_token_head", "NHD", 4, 2, 4),   # NHD: permute on receive
    Scenario(4, "bf16", "HND", 2, 8, 1),                 # P > H: GQA de-duplicated ranks
]


def prefill(seed, addr_file):
  server = remote.start_server()
  offers = []
  for sc in SCENARIOS:
    pspec, _ = sc.specs()
    k, v = sc.kv(seed)
    caches = TD.write_rank_caches(pspec, sc.p, sc.total_heads, k, v, SRC_BLOCKS, PREFILL_BLOCKS,
                                  jax.devices()[:sc.p], **sc.scales)
    ranks = remote.needed_remote_ranks(sc.d, sc.p, sc.total_heads)
    offers.append(remote.offer_request(server, sc.request_id, caches, SRC_BLOCKS, ranks=ranks))
  tmp = addr_file + ".tmp"
  with open(tmp, "w") as f:
    f.write(server.address())
  os.replace(tmp, addr_file)
  sys.stdin.readline()   # the test says when the decode side is done
  return offers


def decode(seed, address, out_npz):
  server = remote.start_server()
  result = {}
  for sc in SCENARIOS:
    _, dspec = sc.specs()
    poison = TD.poison_caches(dspec, sc.d, DECODE_BLOCKS, seed + 100 + sc.request_id)
    devs = jax.devices()
    caches = [jax.device_put(poison[r], devs[(sc.p + r) % 8]) for r in range(sc.d)]
    caches, pulled = remote.pull_request(server, address, sc.request_id, caches, dspec,
                                         DST_BLOCKS, remote_tp_size=sc.p,
                                         total_num_kv_heads=sc.total_heads, timeout_s=30)
    for r, c in enumerate(caches):
      result[f"s{sc.request_id}_r{r}"] = TD.as_bytes(c)
    result[f"s{sc.request_id}_pulled"] = np.asarray(pulled)
  np.savez(out_npz, **result)


if __name__ == "__main__":
  role, seed = sys.argv[1], int(sys.argv[2])
  if role == "prefill":
    prefill(seed, sys.argv[3])
  elif role == "decode":
    decode(seed, sys.argv[3], sys.argv[4])
  else:
    raise SystemExit(f"unknown role {role!r}")
