"""The CUDA IPC transport (kvjax.transfer.ipc_transport): its protocol on CPU, and on a GPU two
processes that share it.

On CPU the protocol runs over host memory standing in for device memory (tests/_host_ipc_memory.py):
the slab allocator, one pull per offer, error answers at once, a release during a read that
frees the piece only once the reader acknowledges, a stalled server bounded by the pull's
timeout, address checks. The pulls themselves (every format, both cache forms) run over both
transports in tests/test_transfer_layers.py.

On a CUDA GPU (compiled tier), a prefill and a decode process on the one GPU
(tests/_transfer_gpu_peer.py): every cache format and both layouts, per-layer and layered
caches, arrive byte-exact at the decode side's own block ids in one pull; a killed or stopped
prefill process fails the pull within its timeout with the caches unchanged, and the same
decode process serves the next request.
"""
import os
import signal
import socket
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _host_ipc_memory as HM
import _peer_process as PP
import _transfer_data as TD
import _transfer_gpu_peer as GPEER
import kvjax
from kvjax.transfer import all_layers as AL
from kvjax.transfer import ipc_transport as IPC
from kvjax.transfer.addresses import CUDA_IPC_SCHEME
from kvjax.transfer import remote
from kvjax.transfer import slabs as SL

GPU_PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_transfer_gpu_peer.py")
DEVICE = jax.devices("cpu")[0]


def _rows(rng, n, row_bytes):
  return jnp.asarray(rng.integers(0, 256, (n, row_bytes), dtype=np.uint8), device=DEVICE)


def _pair():
  mem = HM.HostMemory()
  return mem, IPC.IpcServer(memory=mem), IPC.IpcServer(memory=mem)


def test_slabs_first_fit_reuse_merge_and_growth():
  mem = HM.HostMemory()
  slabs = SL.Slabs(mem, DEVICE, slab_bytes=4096)
  a, b, c = slabs.take(1000), slabs.take(1000), slabs.take(1000)
  assert (a.slab, a.offset, b.offset, c.offset) == (0, 0, 1024, 2048)   # 256-byte aligned
  assert a.ptr == mem.fills[0] if mem.fills else a.ptr > 0
  slabs.give(b)
  assert slabs.take(900).offset == 1024            # first fit reuses the hole
  big = slabs.take(10000)                          # larger than a slab: a slab of its own
  assert (big.slab, big.offset, slabs.capacity) == (1, 0, 4096 + 10240)
  slabs.give(a)
  slabs.give(slabs.take(10))                       # merged back into the hole at 0
  assert slabs.take(1024).offset == 0
  handles = {h for _, h in slabs.handles()}
  assert len(handles) == 2 and {a.handle, big.handle} == handles
  slabs.free_all()
  assert not mem.buffers and slabs.capacity == 0


def test_one_pull_per_offer_and_errors_answered_at_once(rng):
  mem, prefill, decode = _pair()
  rows = _rows(rng, 3, 700)
  want = np.asarray(rows)
  withdraw = prefill.serve({11: rows, 12: _rows(rng, 3, 700)}, ttl_s=30)
  assert rows.is_deleted()                          # copied into shared memory
  deadline = time.monotonic() + 30
  got, done = decode.fetch(prefill.address(), {11: ((3, 700), DEVICE)}, deadline, 30)
  assert got[11].shape == (IPC.padded_rows(3), 700) == (4, 700)   # the piece's room
  np.testing.assert_array_equal(np.asarray(got[11])[:3], want)
  done()
  t0 = time.monotonic()
  for tid, shape, match in [(11, (3, 700), "already pulled"), (99, (3, 700), "no offer"),
                            (12, (3, 699), "holds 2100 bytes, the pull expects 2097")]:
    with pytest.raises(remote.PullError, match=match):
      decode.fetch(prefill.address(), {tid: (shape, DEVICE)}, deadline, 30)
  assert time.monotonic() - t0 < 5                  # answers, not deadlines
  got, done = decode.fetch(prefill.address(), {12: ((3, 700), DEVICE)}, deadline, 30)
  done()
  assert len(mem.opened) == 1                       # one mapping of the slab, reused
  withdraw()
  withdraw()                                        # idempotent
  prefill.close()
  decode.close()
  assert not mem.buffers and mem.closed == mem.opened


def test_padded_rows_are_a_few_sizes():
  assert [IPC.padded_rows(n) for n in (1, 2, 3, 5, 128, 129, 256, 257, 700)] == \
      [1, 2, 4, 8, 128, 256, 256, 512, 768]


def test_requests_of_lengths_in_one_size_share_one_receive_program(rng):
  spec = kvjax.KVCacheSpec(2, 32, 16, layout="NHD")
  server = IPC.IpcServer(memory=HM.HostMemory())
  prefill = [jax.device_put(TD.poison_caches(spec, 1, 12, s)[0], DEVICE) for s in (1, 2)]
  decode = [jax.device_put(TD.poison_caches(spec, 1, 12, s)[0], DEVICE) for s in (3, 4)]
  want = [np.asarray(TD.as_bytes(c)).copy() for c in decode]
  sizes = []
  for src, dst in (([5, 1, 9], [0, 4, 8]), ([2, 3, 7, 11, 0], [1, 2, 3, 5, 6]),
                   ([10, 6, 4, 8, 1, 3, 2], [7, 9, 10, 11, 0, 4, 8])):   # 3, 5, 7 pages
    with remote.offer_request_layers(server, [prefill], src, spec=spec, ttl_s=30) as offer:
      (decode,), _ = remote.pull_request_layers(server, server.address(), [decode], spec, dst,
                                                token=offer.token, remote_tp_size=1,
                                                total_num_kv_heads=2, timeout_s=30)
    for layer in range(2):
      want[layer][dst] = np.asarray(TD.as_bytes(prefill[layer]))[src]
      np.testing.assert_array_equal(np.asarray(TD.as_bytes(decode[layer])), want[layer])
    sizes.append(AL._land_list._cache_size())
  assert sizes[2] == sizes[1]          # 5 and 7 pages: one program (8 rows), 3 pages: another
  server.close()


def test_views_of_memory_read_in_place_are_imported_once_per_piece(rng):
  mem = HM.HostMemory()
  mem.views_alias = True                            # as CUDA IPC views are (here: bookkeeping)
  prefill, decode = IPC.IpcServer(memory=mem), IPC.IpcServer(memory=mem)
  got = []
  for tid in (1, 2, 3):
    withdraw = prefill.serve({tid: _rows(rng, 2, 512)}, ttl_s=30)
    arrays, done = decode.fetch(prefill.address(), {tid: ((2, 512), DEVICE)},
                                time.monotonic() + 30, 30)
    got.append((mem.fills[-1], arrays[tid]))
    done()
    withdraw()
    deadline = time.monotonic() + 10                # the server handles "done" on its thread
    while prefill._entries and time.monotonic() < deadline:
      time.sleep(0.01)
  same_piece = [a for ptr, a in got if ptr == got[0][0]]
  assert len(same_piece) >= 2 and all(a is same_piece[0] for a in same_piece)
  assert len(mem.views) == len({ptr for ptr, _ in got})   # one import per piece address
  prefill.close()
  decode.close()


def test_release_during_a_read_frees_the_piece_after_the_acknowledgement(rng):
  mem, prefill, decode = _pair()
  withdraw = prefill.serve({1: _rows(rng, 2, 512)}, ttl_s=30)
  first = mem.fills[-1]
  got, done = decode.fetch(prefill.address(), {1: ((2, 512), DEVICE)}, time.monotonic() + 30, 30)
  assert mem.views[-1] == first
  withdraw()                                        # released while being read
  prefill.serve({2: _rows(rng, 2, 512)}, ttl_s=30)
  assert mem.fills[-1] != first                     # the piece being read is not handed out
  done()
  deadline = time.monotonic() + 10                  # the server handles "done" on its thread
  while True:
    prefill.serve({3: _rows(rng, 2, 512)}, ttl_s=30)
    if mem.fills[-1] == first or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert mem.fills[-1] == first                     # ...and is reused once acknowledged
  prefill.close()
  decode.close()


def test_a_lost_reader_frees_its_pieces(rng):
  mem, prefill, decode = _pair()
  withdraw = prefill.serve({5: _rows(rng, 1, 256)}, ttl_s=30)
  decode.fetch(prefill.address(), {5: ((1, 256), DEVICE)}, time.monotonic() + 30, 30)
  first = mem.fills[-1]
  withdraw()
  decode.close()                                    # the reader's connection ends, no "done"
  deadline = time.monotonic() + 10
  while True:
    prefill.serve({6: _rows(rng, 1, 256)}, ttl_s=30)
    if mem.fills[-1] == first or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert mem.fills[-1] == first
  prefill.close()


def test_a_silent_server_times_out_and_a_closed_one_fails_fast():
  _, _, decode = _pair()
  silent = socket.create_server(("127.0.0.1", 0))    # accepts, never answers
  accepted = []
  threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
  address = f"{CUDA_IPC_SCHEME}127.0.0.1:{silent.getsockname()[1]}"
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match="within 1 s"):
    decode.fetch(address, {1: ((1, 256), DEVICE)}, time.monotonic() + 1.0, 1.0)
  assert 0.9 < time.monotonic() - t0 < 1.0 + PP.SLACK_S
  silent.close()
  closed = IPC.IpcServer(memory=HM.HostMemory())
  gone = closed.address()
  closed.close()
  with pytest.raises(remote.PullError, match="could not connect"):
    decode.fetch(gone, {1: ((1, 256), DEVICE)}, time.monotonic() + 5, 5)
  decode.close()


def test_pulls_into_fresh_and_pulled_caches_share_one_program():
  """Caches from spec.allocate (uncommitted) and those a pull returns (committed) take the same
  compiled receive program: the second request of a decode process compiles nothing."""
  _, prefill, decode = _pair()
  spec = kvjax.KVCacheSpec(2, 32, 16, layout="HND")
  src = [spec.allocate(4) for _ in range(3)]
  caches = [spec.allocate(5) for _ in range(3)]
  before = AL._land_list._cache_size()
  for _ in range(3):
    offer = remote.offer_request_layers(prefill, [src], [1], spec=spec)
    (caches,), _ = remote.pull_request_layers(decode, prefill.address(), [caches], spec, [2],
                                              token=offer.token, remote_tp_size=1,
                                              total_num_kv_heads=2)
    offer.release()
  assert AL._land_list._cache_size() == before + 1
  prefill.close()
  decode.close()


def test_addresses_and_transports_are_checked():
  with pytest.raises(ValueError, match="transport must be one of"):
    remote.start_server(transport="rdma")
  with pytest.raises(ValueError, match="not a loopback"):
    IPC.IpcServer("0.0.0.0:0", memory=HM.HostMemory())
  ipc = IPC.IpcServer(memory=HM.HostMemory())
  sock = remote.start_server()
  with pytest.raises(ValueError, match="CUDA IPC server's address"):
    ipc.fetch(sock.address(), {1: ((1, 1), DEVICE)}, time.monotonic() + 1, 1)
  with pytest.raises(ValueError, match="transport='cuda_ipc'"):
    sock.fetch(ipc.address(), {1: ((1, 1), DEVICE)}, time.monotonic() + 1, 1)
  ipc.close()


# -- two processes on one CUDA GPU -------------------------------------------------------------
def _gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


needs_gpu = pytest.mark.skipif(_gpu() is None, reason="needs a CUDA GPU (two processes share it)")


@pytest.fixture
def gpu_peers(tmp_path):
  with PP.Peers(tmp_path, GPU_PEER) as start:
    yield start


def _ask_pull(decode, router, i, timeout_s, out):
  job = dict(router["offers"][i], address=router["address"], timeout_s=timeout_s, out=str(out))
  res = decode.ask(job, timeout_s + PP.SLACK_S + 60)
  got = np.load(out)
  return res, [got[f"arr_{layer}"] for layer in range(GPEER.LAYERS)]


@needs_gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "socket"])
def test_two_processes_one_gpu_every_format(rng, tmp_path, gpu_peers, transport):
  seed = int(rng.integers(2**20))
  names = list(GPEER.SCENARIOS)
  router_file = str(tmp_path / "router.json")
  prefill = gpu_peers("prefill", "prefill", seed, router_file, transport, ",".join(names))
  decode = gpu_peers("decode", "decode", seed, transport)
  want = {n: [TD.as_bytes(x) for x in GPEER.expected_decode_layers(n, seed)] for n in names}
  router = prefill.wait_json(router_file)
  assert router["address"].startswith(CUDA_IPC_SCHEME if transport == "cuda_ipc" else "127.0.0.1:")
  for i, name in enumerate(names):
    res, got = _ask_pull(decode, router, i, 60, tmp_path / f"{name}.npz")
    assert res["outcome"] == "ok", (name, res)
    for layer in range(GPEER.LAYERS):
      np.testing.assert_array_equal(got[layer], want[name][layer], err_msg=f"{name} {layer}")
  assert prefill.ask({}, 30)["live_offers"] == len(names)   # pulled, held until released


@needs_gpu
def test_killed_or_stopped_prefill_fails_the_pull_and_decode_serves_the_next(rng, tmp_path,
                                                                            gpu_peers):
  seed, name, short_s = int(rng.integers(2**20)), "bf16-hnd", 3.0
  dead_file, live_file = str(tmp_path / "dead.json"), str(tmp_path / "live.json")
  dead = gpu_peers("dead prefill", "prefill", seed, dead_file, "cuda_ipc", name)
  live = gpu_peers("live prefill", "prefill", seed, live_file, "cuda_ipc", f"{name},{name}")
  decode = gpu_peers("decode", "decode", seed, "cuda_ipc")
  poison = [TD.as_bytes(x) for x in GPEER.poisoned_decode_layers(name, seed)]
  want = [TD.as_bytes(x) for x in GPEER.expected_decode_layers(name, seed)]
  to_dead, to_live = dead.wait_json(dead_file), live.wait_json(live_file)
  dead.proc.kill()
  dead.proc.wait(timeout=10)

  def check(res, got, outcomes, expect):
    assert res["outcome"] in outcomes, res
    assert res["elapsed_s"] <= short_s + PP.SLACK_S, res
    for layer in range(GPEER.LAYERS):
      np.testing.assert_array_equal(got[layer], expect[layer])

  check(*_ask_pull(decode, to_dead, 0, short_s, tmp_path / "dead.npz"),
        ("PullError", "TimeoutError"), poison)
  live.proc.send_signal(signal.SIGSTOP)
  try:
    PP.wait_stopped(live.proc.pid)
    check(*_ask_pull(decode, to_live, 0, short_s, tmp_path / "stopped.npz"), ("TimeoutError",),
          poison)
  finally:
    live.proc.send_signal(signal.SIGCONT)
  check(*_ask_pull(decode, to_live, 1, 60, tmp_path / "next.npz"), ("ok",), want)
