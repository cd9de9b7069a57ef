"""One token, one pull round for a request's pages of all layers (offer/pull_request_layers).

In-process over a loopback server of either transport (the socket transport, and the CUDA IPC
protocol over host memory standing in for device memory): per-layer caches of every cache
dtype and layered (cross-layer) caches, in either form on either side, arrive byte-exact at
the decode side's own block ids; a wrong token times out within its timeout with the caches
unchanged; a used token, an expired offer and an offer of another layer count are refused.
Several requests pulled in one round (``pull_requests_layers``) arrive exact; a round with a
bad token fails whole with the caches unchanged (over CUDA IPC the good offer can then be
pulled).
"""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _transfer_* helpers
import _host_ipc_memory as HM
import _transfer_data as TD
from kvjax.transfer import remote
from kvjax.transfer.ipc_transport import IpcServer

LAYERS, TOKENS = 3, 40
SRC, DST = [6, 2, 4], [1, 7, 0]
PREFILL_BLOCKS, DECODE_BLOCKS = 8, 9
SLACK_S = 10.0


@pytest.fixture(scope="module", params=["socket", "cuda_ipc"])
def server(request):
  if request.param == "socket":
    return remote.start_server()
  return IpcServer(memory=HM.HostMemory())   # the pull side maps the offer's own memory


def _not_offered(server):
  """What a pull of a token nobody offers raises: the socket transport learns nothing until its
  deadline; the CUDA IPC server answers at once."""
  return TimeoutError if server.address().startswith("127.") else remote.PullError


def _request(seed, fmt, layout, h, p, d):
  """(prefill per-rank per-layer caches, decode spec, poisoned decode caches as numpy per rank
  per layer, expected decode caches per rank per layer, prefill spec); devices 0..p-1 prefill,
  p..p+d-1 decode."""
  cache_dtype, head_size = TD.FORMATS[fmt]
  scales = dict(k_scale=0.05, v_scale=0.03) if fmt == "nvfp4" else {}
  pspec = TD.rank_spec(cache_dtype, head_size, layout, h, p)
  dspec = TD.rank_spec(cache_dtype, head_size, layout, h, d)
  devs = jax.devices()
  prefill = [[] for _ in range(p)]
  poison = [[] for _ in range(d)]
  want = [[] for _ in range(d)]
  for layer in range(LAYERS):
    k, v = TD.request_kv(seed + layer, TOKENS, h, head_size)
    for r, c in enumerate(TD.write_rank_caches(pspec, p, h, k, v, SRC, PREFILL_BLOCKS, devs[:p],
                                               **scales)):
      prefill[r].append(c)
    fill = TD.poison_caches(dspec, d, DECODE_BLOCKS, seed + 100 + layer)
    for r, c in enumerate(TD.write_rank_caches(dspec, d, h, k, v, DST, DECODE_BLOCKS,
                                               devs[p:p + d], fill=fill, **scales)):
      poison[r].append(fill[r])
      want[r].append(c)
  return prefill, dspec, poison, want, pspec


def _layered(per_layer, spec):
  """A rank's layers stacked into one layered array (``spec.physical_shape(B, L)``)."""
  out = jnp.stack(per_layer, axis=spec.layer_axis)
  assert out.shape == spec.physical_shape(per_layer[0].shape[0], len(per_layer))
  return out


def _decode_caches(poison, dspec, p, layered):
  devs = jax.devices()
  out = []
  for r, layers in enumerate(poison):
    placed = [jax.device_put(x, devs[p + r]) for x in layers]
    out.append(jax.device_put(_layered(placed, dspec), devs[p + r]) if layered else placed)
  return out


def _pull(server, caches, dspec, token, p, h, timeout_s):
  return remote.pull_request_layers(server, server.address(), caches, dspec, DST, token=token,
                                    remote_tp_size=p, total_num_kv_heads=h, timeout_s=timeout_s)


@pytest.mark.parametrize("fmt,layout,h,p,d,src_layered,dst_layered", [
    ("bf16", "HND", 2, 2, 1, False, False),
    ("fp8_per_token_head", "NHD", 4, 2, 4, False, False),   # NHD: permute on receive
    ("nvfp4", "HND", 4, 1, 2, False, False),
    ("bf16", "NHD", 2, 2, 1, True, True),                    # one contiguous run per block
    ("fp8_per_token_head", "HND", 4, 1, 2, True, False),
    ("bf16", "HND", 4, 4, 2, False, True),
])
def test_all_layers_one_token_exact(rng, server, fmt, layout, h, p, d, src_layered, dst_layered):
  seed = int(rng.integers(2**20))
  prefill, dspec, poison, want, pspec = _request(seed, fmt, layout, h, p, d)
  src = [_layered(x, pspec) for x in prefill] if src_layered else prefill
  ranks = remote.needed_remote_ranks(d, p, h)
  with remote.offer_request_layers(server, src, SRC, spec=pspec, ranks=ranks, ttl_s=30) as offer:
    assert offer.num_layers == LAYERS and offer.ranks == tuple(ranks)
    assert offer.nbytes == len(ranks) * LAYERS * len(SRC) * offer.page_bytes
    caches = _decode_caches(poison, dspec, p, dst_layered)
    got, pulled = _pull(server, caches, dspec, offer.token, p, h, 30)
  assert pulled == ranks
  for r in range(d):
    expect = _layered(want[r], dspec) if dst_layered else want[r]
    if dst_layered:
      np.testing.assert_array_equal(TD.as_bytes(got[r]), TD.as_bytes(expect), err_msg=f"rank {r}")
    else:
      assert len(got[r]) == LAYERS
      for layer in range(LAYERS):
        np.testing.assert_array_equal(TD.as_bytes(got[r][layer]), TD.as_bytes(expect[layer]),
                                      err_msg=f"rank {r} layer {layer}")


def test_all_layers_token_ttl_and_timeout(rng, server):
  seed = int(rng.integers(2**20))
  prefill, dspec, poison, want, pspec = _request(seed, "bf16", "HND", 2, 2, 1)
  offer = remote.offer_request_layers(server, prefill, SRC, ttl_s=30)
  caches = _decode_caches(poison, dspec, 2, False)
  t0 = time.monotonic()
  with pytest.raises(_not_offered(server), match="did not complete within 1 s|no offer"):
    _pull(server, caches, dspec, "0" * 16 if offer.token != "0" * 16 else "1" * 16, 2, 2, 1.0)
  assert time.monotonic() - t0 < 1.0 + SLACK_S
  for layer in range(LAYERS):   # not donated, not written
    np.testing.assert_array_equal(TD.as_bytes(caches[0][layer]), TD.as_bytes(poison[0][layer]))
  with pytest.raises(remote.PullError):   # another layer count: the sizes disagree
    _pull(server, [caches[0][:2]], dspec, offer.token, 2, 2, 5.0)
  np.testing.assert_array_equal(TD.as_bytes(caches[0][0]), TD.as_bytes(poison[0][0]))
  offer.release()

  offer = remote.offer_request_layers(server, prefill, SRC, ttl_s=30)
  got, _ = _pull(server, caches, dspec, offer.token, 2, 2, 30)
  for layer in range(LAYERS):
    np.testing.assert_array_equal(TD.as_bytes(got[0][layer]), TD.as_bytes(want[0][layer]))
  fresh = _decode_caches(poison, dspec, 2, False)
  with pytest.raises(_not_offered(server)):   # one offer serves one pull
    _pull(server, fresh, dspec, offer.token, 2, 2, 1.0)
  offer.release()

  base = remote.live_offers().count
  short = remote.offer_request_layers(server, prefill, SRC, ttl_s=0.5)
  deadline = time.monotonic() + 10
  while not short.released and time.monotonic() < deadline:
    time.sleep(0.05)
  assert short.released and remote.live_offers().count == base
  with pytest.raises((TimeoutError, remote.PullError)):   # expired
    _pull(server, fresh, dspec, short.token, 2, 2, 1.0)


def test_all_layers_bad_arguments(rng, server):
  prefill, dspec, poison, _, pspec = _request(int(rng.integers(2**20)), "bf16", "NHD", 2, 2, 1)
  with pytest.raises(ValueError, match="need spec="):
    remote.offer_request_layers(server, [_layered(x, pspec) for x in prefill], SRC)
  with pytest.raises(ValueError, match="disagree on the number of layers"):
    remote.offer_request_layers(server, [prefill[0], prefill[1][:2]], SRC)
  with pytest.raises(ValueError, match="ttl_s must be a positive finite"):
    remote.offer_request_layers(server, prefill, SRC, ttl_s=0)
  with pytest.raises(ValueError, match="rank 2 is not a prefill rank of 2"):
    remote.offer_request_layers(server, prefill, SRC, ranks=[2])
  with pytest.raises(ValueError, match="has no layers"):
    _pull(server, [[]], dspec, "0" * 16, 2, 2, 1.0)
  with pytest.raises(ValueError, match="token must be"):
    _pull(server, _decode_caches(poison, dspec, 2, False), dspec, "abc", 2, 2, 1.0)


def _batch_data(seed, layered):
  """One-rank bf16 NHD caches: prefill pages (random), poisoned decode caches (numpy)."""
  spec = TD.rank_spec("auto", 32, "NHD", 2, 1)
  dev = jax.devices()[0]
  prefill = [jax.device_put(TD.poison_caches(spec, 1, PREFILL_BLOCKS, seed + l)[0], dev)
             for l in range(LAYERS)]
  poison = [TD.poison_caches(spec, 1, DECODE_BLOCKS, seed + 50 + l)[0] for l in range(LAYERS)]
  decode = [jax.device_put(x, dev) for x in poison]
  if layered:
    prefill, decode = _layered(prefill, spec), jax.device_put(_layered(decode, spec), dev)
  return spec, prefill, poison, decode


def _batch_pull(server, spec, caches, dsts, tokens, timeout_s=30):
  return remote.pull_requests_layers(server, server.address(), [caches], spec, dsts,
                                     tokens=tokens, remote_tp_size=1, total_num_kv_heads=2,
                                     timeout_s=timeout_s)


@pytest.mark.parametrize("layered", [False, True], ids=["per-layer", "layered"])
def test_a_batch_of_requests_arrives_in_one_round(rng, server, layered):
  spec, prefill, poison, decode = _batch_data(int(rng.integers(2**20)), layered)
  requests = [([6, 2, 4], [1, 7, 0]), ([3, 5], [2, 8]), ([0, 1, 7, 5], [3, 4, 5, 6])]
  offers = [remote.offer_request_layers(server, [prefill], src, spec=spec, ttl_s=30)
            for src, _ in requests]
  (got,), pulled = _batch_pull(server, spec, decode, [d for _, d in requests],
                               [o.token for o in offers])
  assert pulled == [0]
  for o in offers:
    o.release()
  layer = lambda x, l: jnp.take(x, l, axis=spec.layer_axis) if layered else x[l]  # noqa: E731
  layers = [layer(got, l) for l in range(LAYERS)]
  src_layers = [layer(prefill, l) for l in range(LAYERS)]
  for l in range(LAYERS):
    want = TD.as_bytes(poison[l]).copy()
    for src, dst in requests:
      want[dst] = TD.as_bytes(src_layers[l])[src]
    np.testing.assert_array_equal(TD.as_bytes(layers[l]), want, err_msg=f"layer {l}")


def test_a_batch_fails_whole_and_leaves_the_caches(rng, server):
  spec, prefill, poison, decode = _batch_data(int(rng.integers(2**20)), False)
  good = remote.offer_request_layers(server, [prefill], [6, 2], spec=spec, ttl_s=30)
  bad = "0" * 16 if good.token != "0" * 16 else "1" * 16
  with pytest.raises(_not_offered(server)):
    _batch_pull(server, spec, decode, [[1, 7], [0]], [good.token, bad], timeout_s=1.0)
  for l in range(LAYERS):                      # not donated, not written
    np.testing.assert_array_equal(TD.as_bytes(decode[l]), TD.as_bytes(poison[l]))
  if _not_offered(server) is remote.PullError:   # CUDA IPC: the good offer is offered again
    (got,), _ = _batch_pull(server, spec, decode, [[1, 7]], [good.token])
    np.testing.assert_array_equal(TD.as_bytes(got[0])[[1, 7]], TD.as_bytes(prefill[0])[[6, 2]])
  good.release()
  with pytest.raises(ValueError, match="name the same requests"):
    _batch_pull(server, spec, decode, [[1]], [good.token, bad])
  with pytest.raises(ValueError, match="tokens must be distinct"):
    _batch_pull(server, spec, decode, [[1], [2]], [good.token, good.token])
  with pytest.raises(ValueError, match="must be distinct"):
    _batch_pull(server, spec, decode, [[1, 2], [2]], [good.token, bad])
