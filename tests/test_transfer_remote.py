"""Cross-process transfers over jax.experimental.transfer on 127.0.0.1 (kvjax.transfer.remote).

Separate processes (tests/_transfer_peer.py): a prefill process offers requests' pages; a
decode process with another TP size pulls them, by token, into its own caches at its own
block ids (checked byte-exact and by attention); a thief that knows only the server address
gets nothing; a pull from a killed or stopped prefill process ends in TimeoutError, leaves
the decode caches as they were, and the same decode process serves the next request.
In-process tests cover offer lifetimes (TTL, release, live counts) and argument errors.
Every wait is bounded; every peer ends by itself.
"""
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _transfer_* helpers
import _peer_process as PP
import _transfer_data as TD
import _transfer_peer as PEER
from kvjax.transfer import offers, remote, topology

PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_transfer_peer.py")
PULL_TIMEOUT_S = 30
SHORT_TIMEOUT_S = 3.0   # the failing pulls' timeout_s


@pytest.fixture
def peers(tmp_path):
  with PP.Peers(tmp_path, PEER_SCRIPT) as start:
    yield start


def expected_decode_caches(sc, seed):
  """The decode ranks' caches after the request's pages land on the poisoned caches."""
  _, dspec = sc.specs()
  k, v = sc.kv(seed)
  return TD.write_rank_caches(dspec, sc.d, sc.total_heads, k, v, PEER.DST_BLOCKS,
                              PEER.DECODE_BLOCKS, jax.devices()[:sc.d], fill=sc.poison(seed),
                              **sc.scales)


def load_ranks(path, d):
  got = np.load(path)
  return [got[f"r{r}"] for r in range(d)]


def check_expected_by_attention(sc, seed, want, q):
  """The decode ranks' expected caches, attended per rank and joined over query heads,
  equal attention over one H-head cache written directly with the whole request."""
  _, dspec = sc.specs()
  k, v = sc.kv(seed)
  h, hq = sc.total_heads, q.shape[1]
  meta = (jnp.array([0, 4]), jnp.array([PEER.NUM_TOKENS]), jnp.array([PEER.DST_BLOCKS]),
          sc.head_size ** -0.5, sc.scales.get("k_scale"), sc.scales.get("v_scale"))
  full_spec = TD.rank_spec(sc.cache_dtype, sc.head_size, sc.layout, h, 1)
  full = TD.write_rank_caches(full_spec, 1, h, k, v, PEER.DST_BLOCKS, PEER.DECODE_BLOCKS,
                              jax.devices()[:1], **sc.scales)[0]
  ref = TD.attention(q, full, full_spec, *meta)
  per = hq // sc.d
  one = jax.devices()[0]
  out = jnp.concatenate([TD.attention(q[:, r * per:(r + 1) * per], jax.device_put(want[r], one),
                                      dspec, *meta) for r in range(sc.d)], axis=1)
  assert float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 0
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_only_the_token_holder_pulls_the_pages(rng, tmp_path, peers):
  seed = int(rng.integers(2**20))
  router_file = str(tmp_path / "router.json")
  prefill = peers("prefill", "prefill", seed, router_file, "1:60,2:60,3:60,4:60")
  thief = peers("thief", "thief", seed)
  decode = peers("decode", "decode", seed)
  want = {}
  for rid in (1, 2, 3, 4):   # while the peers start: the expected caches
    sc = PEER.SCENARIOS[rid]
    want[rid] = expected_decode_caches(sc, seed)
    if rid in (3, 4):   # NHD permuted on receive; GQA-replicated ranks (the others: bytes)
      q = jnp.asarray(rng.standard_normal((4, 2 * sc.total_heads, sc.head_size)), jnp.bfloat16)
      check_expected_by_attention(sc, seed, want[rid], q)
  router = prefill.wait_json(router_file)
  address = router["address"]
  assert remote.is_loopback(address), address

  theft = thief.ask({"address": address, "wait_s": 2.0}, PP.START_S)
  assert theft["attempts"] >= 4 * len(router["offers"]) and theft["stolen"] == 0, theft

  for offer in router["offers"]:   # then the token holder pulls the exact pages
    sc = PEER.SCENARIOS[offer["request_id"]]
    out = str(tmp_path / f"decode{sc.request_id}.npz")
    res = decode.ask(dict(offer, address=address, timeout_s=PULL_TIMEOUT_S, out=out), PP.START_S)
    assert res["outcome"] == "ok", res
    assert res["pulled"] == remote.needed_remote_ranks(sc.d, sc.p, sc.total_heads)
    got = load_ranks(out, sc.d)
    for r in range(sc.d):
      np.testing.assert_array_equal(got[r], TD.as_bytes(want[sc.request_id][r]),
                                    err_msg=f"scenario {sc.request_id} rank {r}")


def test_dead_or_stalled_prefill_times_out_and_decode_serves_the_next(rng, tmp_path, peers):
  seed = int(rng.integers(2**20))
  sc = PEER.SCENARIOS[5]
  dead_file, live_file = str(tmp_path / "dead.json"), str(tmp_path / "live.json")
  dead = peers("dead prefill", "prefill", seed, dead_file, "5:60")
  live = peers("live prefill", "prefill", seed, live_file, "5:60,5:60,5:60,5:1")
  decode = peers("decode", "decode", seed)
  poison = [TD.as_bytes(x) for x in sc.poison(seed)]
  want = [TD.as_bytes(x) for x in expected_decode_caches(sc, seed)]
  to_dead = dead.wait_json(dead_file)
  to_live = live.wait_json(live_file)
  published = time.monotonic()
  dead.proc.kill()
  dead.proc.wait(timeout=10)

  def pull(router, i, timeout_s, name):
    out = str(tmp_path / f"{name}.npz")
    job = dict(router["offers"][i], address=router["address"], timeout_s=timeout_s, out=out)
    res = decode.ask(job, timeout_s + PP.SLACK_S + 30)
    return res, load_ranks(out, sc.d)

  def check_failed(res, caches, kinds=("TimeoutError",)):
    assert res["outcome"] in kinds, res
    assert res["elapsed_s"] <= SHORT_TIMEOUT_S + PP.SLACK_S, res
    for r in range(sc.d):   # the caches handed in are intact: no byte was written
      np.testing.assert_array_equal(caches[r], poison[r])

  def check_served(res, caches):
    assert res["outcome"] == "ok", res
    for r in range(sc.d):
      np.testing.assert_array_equal(caches[r], want[r])

  check_failed(*pull(to_dead, 0, SHORT_TIMEOUT_S, "from_dead"))     # killed prefill
  check_served(*pull(to_live, 0, PULL_TIMEOUT_S, "next"))           # the same decode process
  live.proc.send_signal(signal.SIGSTOP)                             # stalled prefill
  try:
    PP.wait_stopped(live.proc.pid)
    check_failed(*pull(to_live, 1, SHORT_TIMEOUT_S, "from_stopped"))
  finally:
    live.proc.send_signal(signal.SIGCONT)
  check_served(*pull(to_live, 2, PULL_TIMEOUT_S, "after_stall"))
  assert time.monotonic() - published > 1.0   # the last offer's 1 s TTL has passed
  check_failed(*pull(to_live, 3, SHORT_TIMEOUT_S, "expired"), kinds=("TimeoutError", "PullError"))


# -- in-process: offer lifetimes, tokens, errors (loopback server of this process) ------------
@pytest.fixture(scope="module")
def server():
  return remote.start_server()


def _small_request(rng):
  """A P=2 -> D=1 bf16 request: (prefill caches, decode spec, poisoned decode cache, want)."""
  sc = PEER.SCENARIOS[5]
  pspec, dspec = sc.specs()
  g = np.random.default_rng(int(rng.integers(2**31)))
  k = jnp.asarray(g.standard_normal((PEER.NUM_TOKENS, 2, sc.head_size)), jnp.bfloat16)
  v = jnp.asarray(g.standard_normal((PEER.NUM_TOKENS, 2, sc.head_size)), jnp.bfloat16)
  devs = jax.devices()
  prefill = TD.write_rank_caches(pspec, 2, 2, k, v, PEER.SRC_BLOCKS, PEER.PREFILL_BLOCKS, devs[:2])
  poison = TD.poison_caches(dspec, 1, PEER.DECODE_BLOCKS, int(g.integers(2**31)))
  want = TD.write_rank_caches(dspec, 1, 2, k, v, PEER.DST_BLOCKS, PEER.DECODE_BLOCKS, devs[2:3],
                              fill=poison)
  return prefill, dspec, poison, want


def _pull(server, offer_or_token, dspec, poison, timeout_s):
  token = getattr(offer_or_token, "token", offer_or_token)
  cache = jax.device_put(poison[0], jax.devices()[2])
  return remote.pull_request(server, server.address(), [cache], dspec, PEER.DST_BLOCKS,
                             token=token, remote_tp_size=2, total_num_kv_heads=2,
                             timeout_s=timeout_s)


def test_offer_served_once_to_its_token(rng, server):
  prefill, dspec, poison, want = _small_request(rng)
  with remote.offer_request(server, prefill, PEER.SRC_BLOCKS, ttl_s=30) as offer:
    assert len(offer.token) == 16 and int(offer.token, 16) >= 0
    assert offer.token not in repr(offer)
    other = offers.new_token()
    assert other != offer.token
    cache = jax.device_put(poison[0], jax.devices()[2])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not complete within 1 s"):
      remote.pull_request(server, server.address(), [cache], dspec, PEER.DST_BLOCKS, token=other,
                          remote_tp_size=2, total_num_kv_heads=2, timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + PP.SLACK_S
    np.testing.assert_array_equal(TD.as_bytes(cache), TD.as_bytes(poison[0]))  # not donated
    (got,), pulled = remote.pull_request(server, server.address(), [cache], dspec,
                                         PEER.DST_BLOCKS, token=offer.token, remote_tp_size=2,
                                         total_num_kv_heads=2, timeout_s=PULL_TIMEOUT_S)
    assert pulled == [0, 1]
    np.testing.assert_array_equal(TD.as_bytes(got), TD.as_bytes(want[0]))
    with pytest.raises(TimeoutError):   # one offer serves one pull
      _pull(server, offer, dspec, poison, 1.0)
  assert offer.released


def test_offer_ttl_and_release_free_the_pages(rng, server):
  prefill, dspec, poison, _ = _small_request(rng)
  base = remote.live_offers()
  n, page_bytes = len(PEER.SRC_BLOCKS), topology.remote_spec(dspec, 2, 2).page_bytes
  short = remote.offer_request(server, prefill, PEER.SRC_BLOCKS, ttl_s=0.5)
  kept = remote.offer_request(server, prefill, PEER.SRC_BLOCKS, ranks=[1], ttl_s=60)
  assert short.nbytes == 2 * n * page_bytes and kept.nbytes == n * page_bytes
  assert remote.live_offers() == (base.count + 2, base.nbytes + 3 * n * page_bytes)
  arrays = list(short.arrays.values())
  deadline = time.monotonic() + 10   # the reaper releases it 0.5 s after the offer
  while remote.live_offers().count > base.count + 1 and time.monotonic() < deadline:
    time.sleep(0.05)
  assert remote.live_offers() == (base.count + 1, base.nbytes + n * page_bytes)
  assert short.released and all(a.is_deleted() for a in arrays)
  with pytest.raises((TimeoutError, remote.PullError)):   # expired: no bytes for the token
    _pull(server, short, dspec, poison, 1.0)

  arrays = list(kept.arrays.values())
  kept.release()
  kept.release()   # idempotent
  assert remote.live_offers() == base and all(a.is_deleted() for a in arrays)


def test_released_offer_fails_fast(rng, server):
  prefill, dspec, poison, _ = _small_request(rng)
  offer = remote.offer_request(server, prefill, PEER.SRC_BLOCKS, ttl_s=60)
  offer.release()
  t0 = time.monotonic()
  with pytest.raises(remote.PullError, match="decode caches are untouched"):
    _pull(server, offer, dspec, poison, PULL_TIMEOUT_S)
  assert time.monotonic() - t0 < PULL_TIMEOUT_S / 2   # an error answer, not the deadline


@pytest.mark.parametrize("address,ok", [
    ("127.0.0.1:0", True), ("127.8.9.10:5000", True), ("[::1]:0", True),
    ("0.0.0.0:0", False), ("[::]:0", False), ("10.1.2.3:0", False), ("localhost:0", False),
    ("127.0.0.1", False)])
def test_is_loopback(address, ok):
  assert remote.is_loopback(address) is ok


def test_non_loopback_bind_needs_allow_remote():
  with pytest.raises(ValueError, match=r"address='0.0.0.0:0'.*allow_remote=True"):
    remote.start_server(address="0.0.0.0:0")
  with pytest.raises(ValueError, match=r"transport_addresses='10.0.0.1:0'.*allow_remote=True"):
    remote.start_server(transport_addresses=["127.0.0.1:0", "10.0.0.1:0"])
  with pytest.raises(ValueError, match="transport_addresses must name"):
    remote.start_server(transport_addresses=[])


def test_bad_arguments(rng, server):
  prefill, dspec, poison, _ = _small_request(rng)
  for ttl in (0, -1.0, float("inf"), None, True):
    with pytest.raises(ValueError, match="ttl_s must be a positive finite"):
      remote.offer_request(server, prefill, PEER.SRC_BLOCKS, ttl_s=ttl)
  with pytest.raises(ValueError, match="block_ids must name at least one"):
    remote.offer_request(server, prefill, [])
  with pytest.raises(ValueError, match=r"block_ids must lie in \[0, 8\)"):
    remote.offer_request(server, prefill, [1, 8])
  with pytest.raises(ValueError, match="rank 2 is not a prefill rank of 2"):
    remote.offer_request(server, prefill, [1], ranks=[2])
  secret = "f" * 15 + "g"
  for token, why in ((12345, "got a int"), ("abc", "got a string of length 3"),
                     (secret, "it has other characters")):
    with pytest.raises(ValueError, match=f"token must be .*{why}") as e:
      _pull(server, token, dspec, poison, 1.0)
    assert secret not in str(e.value)
  with pytest.raises(ValueError, match="timeout_s must be a positive finite"):
    _pull(server, "0" * 16, dspec, poison, 0)
