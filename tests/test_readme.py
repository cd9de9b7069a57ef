"""Every code block of README.md runs as written: python blocks on CPU, example commands exist."""
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from xla_cpu import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


def _env():
  return subprocess_env(PYTHONPATH=str(ROOT))


# One interpreter runs every block in turn, each in a fresh namespace (a block that needed
# another's names would fail), which saves starting jax and torch once per block.
_DRIVER = """
import sys
for i, code in enumerate(sys.argv[1:]):
  print(f"--- README python block {i}", flush=True)
  exec(compile(code, f"<README python block {i}>", "exec"), {"__name__": "__main__"})
"""


def test_python_blocks_run():
  try:
    import torch  # noqa: F401
  except ImportError:
    blocks = [code for code in PYTHON if "import torch" not in code]
  else:
    blocks = PYTHON
  assert blocks
  proc = subprocess.run([sys.executable, "-c", _DRIVER, *blocks], cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert f"--- README python block {len(blocks) - 1}" in proc.stdout


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


def test_examples_list_names_every_example():
  """The README's Examples section runs every script and the notebook in examples/, and no other."""
  section = README.split("## Examples", 1)[1].split("\n## ", 1)[0]
  named = set(re.findall(r"examples/([\w.-]+\.(?:py|ipynb))", section))
  present = {p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".ipynb")}
  assert named == present, f"README lists {sorted(named)}, examples/ holds {sorted(present)}"


def test_first_screen():
  """What kvjax is, the quick start, a first look and the examples come first, in ~60 lines."""
  heads = [line for line in README.splitlines()[:70] if line.startswith("## ")]
  assert heads[:3] == ["## Quick start", "## A first look", "## Examples"], heads
  quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
  # the CPU build of torch is named before any command that installs torch
  assert quick.index("download.pytorch.org/whl/cpu") < quick.index("pip install -e")
