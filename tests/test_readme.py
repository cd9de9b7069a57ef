"""Every code block of README.md runs as written: python blocks on CPU, example commands exist."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  return env


@pytest.mark.parametrize("code", PYTHON, ids=[f"python-{i}" for i in range(len(PYTHON))])
def test_python_block_runs(code):
  if "import torch" in code:
    pytest.importorskip("torch")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_bash_blocks_name_real_files_and_options():
  """Commands in bash blocks: scripts and notebooks exist; pip extras are declared."""
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert PYTHON and BASH
  for block in BASH:
    for line in block.splitlines():
      line = line.split("#", 1)[0].strip()
      for part in filter(None, (p.strip() for p in line.split("&&"))):
        words = shlex.split(part)
        for w in words:
          if w.endswith((".py", ".ipynb")) and not w.startswith("-"):
            assert (ROOT / w).exists(), f"README names {w}, which does not exist"
          for extra in re.findall(r'\.\[([\w,]+)\]', w):
            for name in extra.split(","):
              assert re.search(rf"^{name} = \[", pyproject, flags=re.M), f"no extra {name!r}"
