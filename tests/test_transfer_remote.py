"""Cross-process transfer over jax.experimental.transfer on 127.0.0.1: a prefill process
offers a request's pages, a decode process with another TP size pulls and writes them
into its own cache at its own block ids; checked byte-exact and by attention."""
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _transfer_* helpers
import _transfer_data as TD
import _transfer_peer as PEER
from kvjax.transfer import remote

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_transfer_peer.py")
TIMEOUT_S = 90


def _env():
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(PEER_SCRIPT))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  return env


def run_peers(tmp_path, seed):
  """Start the prefill peer, run the decode peer against it; return the decode results."""
  addr_file = str(tmp_path / "prefill.addr")
  out_npz = str(tmp_path / "decode.npz")
  prefill = subprocess.Popen([sys.executable, PEER_SCRIPT, "prefill", str(seed), addr_file],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
  try:
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(addr_file):
      if prefill.poll() is not None:
        pytest.fail(f"prefill peer exited with {prefill.returncode}: {prefill.stderr.read()}")
      if time.monotonic() > deadline:
        pytest.fail("prefill peer did not publish its address in time")
      time.sleep(0.1)
    address = open(addr_file).read().strip()
    assert address.startswith("127.0.0.1:"), address
    decode = subprocess.run([sys.executable, PEER_SCRIPT, "decode", str(seed), address, out_npz],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert decode.returncode == 0, decode.stderr[-3000:]
    prefill.stdin.write("done\n")
    prefill.stdin.flush()
    prefill.wait(timeout=30)
    assert prefill.returncode == 0, prefill.stderr.read()[-3000:]
    return dict(np.load(out_npz))
  finally:
    if prefill.poll() is None:
      prefill.kill()
      prefill.wait(timeout=10)


def test_cross_process_transfer(rng, tmp_path):
  seed = int(rng.integers(2**20))
  got = run_peers(tmp_path, seed)
  devs = jax.devices()
  for sc in PEER.SCENARIOS:
    _, dspec = sc.specs()
    k, v = sc.kv(seed)
    h = sc.total_heads
    assert got[f"s{sc.request_id}_pulled"].tolist() == remote.needed_remote_ranks(sc.d, sc.p, h)
    poison = TD.poison_caches(dspec, sc.d, PEER.DECODE_BLOCKS, seed + 100 + sc.request_id)
    want = TD.write_rank_caches(dspec, sc.d, h, k, v, PEER.DST_BLOCKS, PEER.DECODE_BLOCKS,
                                devs[:sc.d], fill=poison, **sc.scales)
    pulled = []
    for r in range(sc.d):
      raw = got[f"s{sc.request_id}_r{r}"]
      np.testing.assert_array_equal(raw, TD.as_bytes(want[r]),
                                    err_msg=f"scenario {sc.request_id} rank {r}")
      pulled.append(jnp.asarray(raw.view(dspec.storage_dtype)))

    # Attention: decode ranks' outputs over their pulled caches, joined over query heads,
    # equal attention over one H-head cache written directly with the whole request.
    hq = 2 * h
    q = jnp.asarray(rng.standard_normal((4, hq, sc.head_size)), jnp.bfloat16)
    meta = (jnp.array([0, 4]), jnp.array([PEER.NUM_TOKENS]), jnp.array([PEER.DST_BLOCKS]),
            sc.head_size ** -0.5, sc.scales.get("k_scale"), sc.scales.get("v_scale"))
    full_spec = TD.rank_spec(sc.cache_dtype, sc.head_size, sc.layout, h, 1)
    full = TD.write_rank_caches(full_spec, 1, h, k, v, PEER.DST_BLOCKS, PEER.DECODE_BLOCKS,
                                devs[:1], **sc.scales)[0]
    ref = TD.attention(q, full, full_spec, *meta)
    per = hq // sc.d
    outs = [TD.attention(q[:, r * per:(r + 1) * per], pulled[r], dspec, *meta)
            for r in range(sc.d)]
    out = jnp.concatenate(outs, axis=1)
    assert float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
