"""HF's Llama driven from torch, its attention computed by kvjax through the vLLM adapter.

The model is HF transformers' own ``LlamaForCausalLM`` (weights from the GGUF file); only its
attention function is replaced, through transformers' ``AttentionInterface``, by one that does
what vLLM does with an attention backend: per layer ``impl.do_kv_cache_update(layer, key,
value, kv_cache, slot_mapping)`` then ``impl.forward(layer, query, key, value, kv_cache,
attn_metadata, output)``, where ``impl`` is ``torch_bridge.KVJaxAttentionImpl`` and
``kv_cache`` a torch-owned paged cache (vLLM's logical ``(B, H, N, C)`` view, any cache
dtype and layout). HF's own KV cache is off (``use_cache=False``): each step feeds only the
new tokens of a ragged batch, packed ``[1, T]`` with their absolute positions, and the pages
hold the history.

The host side is kvjax's paging helpers (block tables, one step's metadata padded to a few
shapes), the metadata handed over as vLLM's ``KVJaxAttentionMetadata`` with
``num_actual_tokens`` (rows past it are padding).
"""
from __future__ import annotations

import numpy as np
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import dtypes
from kvjax.paging import BlockAllocator, BlockTables, StepShapes, blocks_for, build_step_metadata

ATTENTION_NAME = "kvjax_paged"      # the name registered with transformers' AttentionInterface
BLOCK_SIZE = 16


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     kvjax_step=None, **kwargs):
  """transformers' attention-function signature, computed by the vLLM adapter.

  ``query [1, Hq, T, D]``, ``key`` / ``value [1, H, T, D]`` (after RoPE); ``kvjax_step``:
  ``(PagedLlama, KVJaxAttentionMetadata)`` of the step, passed down from the model's call.
  Returns ``([1, T, Hq, D], None)`` as HF's attention functions do.
  """
  runner, metadata = kvjax_step
  q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))   # [T, heads, D]
  cache = runner.caches[module.layer_idx]
  runner.impl.do_kv_cache_update(module, k, v, cache, metadata.slot_mapping)
  out = torch.empty_like(q)
  runner.impl.forward(module, q, k, v, cache, metadata, out)
  return out[None], None


class PagedLlama:
  """A HF Llama whose attention runs on kvjax paged caches through the vLLM adapter.

  Args:
    model: a transformers ``LlamaForCausalLM`` (float32, bfloat16 or float16), eval mode.
    cache_dtype: a kvjax cache dtype ("auto" = the model dtype).
    layout: "NHD" or "HND" (nvfp4 needs HND).
    num_blocks: pages per layer's cache.
    max_seqs, max_len: most sequences in a step, longest sequence (prompt + generated).
    k_scale: the global scale of fp8 per-tensor / nvfp4 caches (the layers' ``_k_scale``
      and ``_v_scale``, as vLLM keeps them).
  """

  def __init__(self, model, cache_dtype="auto", layout="NHD", *, num_blocks=64, max_seqs=8,
               max_len=256, k_scale=1.0):
    from transformers import AttentionInterface
    cfg = model.config
    head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    self.model = model
    self.spec = kvjax.KVCacheSpec(cfg.num_key_value_heads, head_size, BLOCK_SIZE, cache_dtype,
                                  layout, dtypes.numpy_dtype(dtype))
    self.impl = tb.KVJaxAttentionImpl(num_heads=cfg.num_attention_heads, head_size=head_size,
                                      scale=head_size ** -0.5,
                                      num_kv_heads=cfg.num_key_value_heads,
                                      kv_cache_dtype=cache_dtype)
    self.caches = [tb.empty_cache(self.spec, num_blocks, device=device)
                   for _ in range(cfg.num_hidden_layers)]
    for layer in model.model.layers:          # vLLM keeps the global scales on the layer
      layer.self_attn._k_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
      layer.self_attn._v_scale = torch.tensor(k_scale, dtype=torch.float32, device=device)
    AttentionInterface.register(ATTENTION_NAME, _paged_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    self.max_len = max_len
    self._graphs = {}                         # decode step shapes -> _DecodeGraph
    self.tables = BlockTables(BlockAllocator(num_blocks), BLOCK_SIZE)
    self.shapes = StepShapes(block_size=BLOCK_SIZE, max_seqs=max_seqs,
                             max_blocks_per_seq=blocks_for(max_len, BLOCK_SIZE),
                             token_buckets=(16, 64, 256))
    self.device = device

  def _step_metadata(self, seq_ids, tokens, num_cached):
    for s, new, cached in zip(seq_ids, tokens, num_cached):
      self.tables.reserve(s, cached + len(new))
    md = build_step_metadata(self.shapes, [self.tables.blocks(s) for s in seq_ids], num_cached,
                             [len(t) for t in tokens])
    ids = np.zeros(md.positions.shape, np.int64)
    ids[:md.num_tokens] = np.concatenate(tokens)
    return md, ids

  def _last_rows(self, md, logits):
    last = torch.as_tensor(md.query_start_loc[1:md.num_seqs + 1] - 1, device=logits.device)
    return logits[last].float()

  def graph_step(self, seq_ids, tokens, num_cached):
    """:meth:`step` for a pure decode step (one new token per sequence), replayed from a CUDA
    graph: the first decode step of a shape runs eagerly (it compiles the kernels), is
    captured into a graph over fixed input tensors, and every later one copies its ids,
    positions and metadata into those tensors and replays the graph. Needs the kernels
    launched on torch's stream (a Hopper GPU, a 16-bit model, a bf16 / f16 / fp8 cache)."""
    md, ids = self._step_metadata(seq_ids, tokens, num_cached)
    key = (ids.shape, md.block_table.shape, md.query_start_loc.shape)
    graph = self._graphs.get(key)
    if graph is None:
      graph = self._graphs[key] = _DecodeGraph(self, md, ids)
    return self._last_rows(md, graph.run(md, ids))

  def step(self, seq_ids, tokens, num_cached):
    """One forward of a ragged batch; returns the float32 logits ``[S, V]`` at each
    sequence's last new token.

    ``seq_ids``: the sequences (any hashable ids); ``tokens``: per sequence its new token ids
    (a prompt or a chunk of it, or one token); ``num_cached``: per sequence, the tokens
    already in its pages.
    """
    md, ids = self._step_metadata(seq_ids, tokens, num_cached)
    as_torch = lambda a: torch.as_tensor(a, device=self.device)
    metadata = tb.KVJaxAttentionMetadata(
        query_start_loc=as_torch(md.query_start_loc), seq_lens=as_torch(md.seq_lens),
        block_table=as_torch(md.block_table), slot_mapping=as_torch(md.slot_mapping),
        max_query_len=md.max_query_len, max_seq_len=int(md.seq_lens.max()),
        num_actual_tokens=md.num_tokens)
    with torch.no_grad():
      logits = self.model(input_ids=as_torch(ids)[None], position_ids=as_torch(md.positions)[None],
                          use_cache=False, kvjax_step=(self, metadata)).logits[0]
    return self._last_rows(md, logits)

  def generate(self, prompts_ids, max_new: int, eos_id=None, cuda_graphs: bool = False):
    """Greedy continuations of every prompt, served together: one ragged prefill step, then
    decode steps of every unfinished sequence; a finished sequence's pages are freed at once.
    ``cuda_graphs``: decode steps replay a CUDA graph (:meth:`graph_step`).
    Returns one list of generated ids per prompt."""
    seqs = {i: list(p) for i, p in enumerate(prompts_ids)}
    cached = {i: 0 for i in seqs}
    generated = {i: [] for i in seqs}
    while seqs:
      order = list(seqs)
      new = [seqs[i][cached[i]:] for i in order]
      decode = cuda_graphs and all(len(t) == 1 for t in new)
      logits = (self.graph_step if decode else self.step)(order, new, [cached[i] for i in order])
      for i, token in zip(order, logits.argmax(-1).tolist()):
        cached[i] = len(seqs[i])
        seqs[i].append(token)
        generated[i].append(token)
        if len(generated[i]) == max_new or token == eos_id:
          del seqs[i]
          self.tables.free(i)
    return [generated[i] for i in range(len(prompts_ids))]


class _DecodeGraph:
  """One decode step shape of a :class:`PagedLlama` captured in a CUDA graph: the input
  tensors it reads (ids, positions, the step's metadata) and the logits it writes. The
  metadata says every row is real (``num_actual_tokens`` = rows: padding rows have slot -1
  and a zero-length sequence, and their outputs are not read), so one graph serves every
  step of the shape."""

  def __init__(self, runner: PagedLlama, md, ids):
    dev = runner.device
    self.runner = runner
    self.ids = torch.zeros((1,) + ids.shape, dtype=torch.int64, device=dev)
    self.positions = torch.zeros((1,) + md.positions.shape, dtype=torch.int64, device=dev)
    names = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
    self.meta = {n: torch.zeros(getattr(md, n).shape, dtype=torch.int32, device=dev)
                 for n in names}
    self.metadata = tb.KVJaxAttentionMetadata(
        **self.meta, max_query_len=1, max_seq_len=runner.max_len, num_actual_tokens=ids.size)
    self._fill(md, ids)
    self.logits = self._forward()             # eager: compiles every kernel of the step
    torch.cuda.synchronize(dev)
    self.graph = torch.cuda.CUDAGraph()
    # thread_local: JAX's runtime threads in this process may touch CUDA meanwhile
    with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
      self.logits = self._forward()

  def _forward(self):
    with torch.no_grad():
      return self.runner.model(input_ids=self.ids, position_ids=self.positions, use_cache=False,
                               kvjax_step=(self.runner, self.metadata)).logits[0]

  def _fill(self, md, ids):
    self.ids.copy_(torch.from_numpy(ids)[None])
    self.positions.copy_(torch.from_numpy(md.positions.astype(np.int64))[None])
    for name, t in self.meta.items():
      t.copy_(torch.from_numpy(np.asarray(getattr(md, name), np.int32)))

  def run(self, md, ids):
    """The logits ``[T, V]`` of this step's rows, replayed."""
    self._fill(md, ids)
    self.graph.replay()
    return self.logits
