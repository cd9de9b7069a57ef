"""Peer processes of the cross-process transfer tests: start, ask, wait, stop, all bounded.

A peer answers one JSON line on stdout per JSON job line on stdin; :class:`Peers` starts them
(``with Peers(tmp_path, script) as start: p = start(name, *args)``) and ends every one it
started on exit (SIGCONT first, then EOF on stdin, then a kill).
"""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

START_S = 90        # a peer's start-up (imports, cache writes) on a loaded CI machine
SLACK_S = 10.0      # a failing pull must end within its timeout_s + SLACK_S


def _env():
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  return env


class Peer:
  """A peer process: one JSON line per job on stdin, one JSON line per answer on stdout."""

  def __init__(self, tmp_path, name, script, *args):
    self.name = name
    self.err_path = tmp_path / f"{name}.stderr"
    with open(self.err_path, "w") as err:
      self.proc = subprocess.Popen([sys.executable, script, *map(str, args)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                   text=True, env=_env())
    self._lines = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      self._lines.put(line)
    self._lines.put(None)

  def _fail(self, why):
    pytest.fail(f"{self.name} peer {why}; stderr:\n{self.err_path.read_text()[-3000:]}")

  def ask(self, job, timeout_s):
    self.proc.stdin.write(json.dumps(job) + "\n")
    self.proc.stdin.flush()
    try:
      line = self._lines.get(timeout=timeout_s)
    except queue.Empty:
      self._fail(f"did not answer {job} within {timeout_s} s")
    if line is None:
      self._fail(f"exited with {self.proc.wait(timeout=10)}")
    return json.loads(line)

  def wait_json(self, path, timeout_s=START_S):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
      if self.proc.poll() is not None:
        self._fail(f"exited with {self.proc.returncode}")
      if time.monotonic() > deadline:
        self._fail(f"did not write {path} within {timeout_s} s")
      time.sleep(0.05)
    with open(path) as f:
      return json.load(f)

  def close(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGCONT)
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
      except (subprocess.TimeoutExpired, BrokenPipeError):
        self.proc.kill()
        self.proc.wait(timeout=10)


class Peers:
  """Starts peers of one script; ends them all on exit."""

  def __init__(self, tmp_path, script):
    self.tmp_path, self.script, self.started = tmp_path, script, []

  def __enter__(self):
    def start(name, *args):
      self.started.append(Peer(self.tmp_path, name, self.script, *args))
      return self.started[-1]
    return start

  def __exit__(self, *exc):
    for p in self.started:
      p.close()


def wait_stopped(pid, timeout_s=10.0):
  """Block until every thread of process ``pid`` is stopped (SIGSTOP is delivered asynchronously:
  on a loaded machine a thread may still run for a moment after ``send_signal`` returns)."""
  deadline = time.monotonic() + timeout_s
  states = []
  while time.monotonic() < deadline:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
      try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
          states.append(f.read().rsplit(")", 1)[1].split()[0])
      except FileNotFoundError:   # a thread that ended meanwhile
        pass
    if states and all(s in "tT" for s in states):
      return
    time.sleep(0.01)
  raise AssertionError(f"process {pid} did not stop within {timeout_s} s: thread states {states}")
