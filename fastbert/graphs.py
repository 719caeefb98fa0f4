"""CUDA graphs for BertModel.encode over packed token-count buckets.

At small batch a BERT forward is bound by the host: ~100 kernel launches, each a few microseconds of Python and
driver time, for a few microseconds of GPU work each. A CUDA graph replays all of them with one launch. Graphs need
static shapes, and the packed layout makes the token count the only shape that matters: a call with T real tokens in
n sequences runs the graph captured for the smallest bucket >= T, its inputs copied into static buffers (the spare
tokens belong to no sequence, the spare sequence slots are empty), and the attention grid covers max_seqlen queries
for max_seqs sequences whatever their lengths. So any mix of lengths up to max_seqlen replays without a new capture or
a recompile; a call beyond the largest bucket, with more than max_seqs sequences or a sequence longer than max_seqlen
runs eagerly.

    runner = model.cuda_graphs(token_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), max_seqs=256)
    out = runner(input_ids=ids, attention_mask=mask)      # same outputs as model(...)
    runner.stats                                          # capture seconds, graph pool bytes, replays, eager calls
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .inputs import prepare
from .layout import TokenLayout

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0  # device memory the graphs' shared pool holds (CUDA)
    replays: int = 0
    eager_calls: int = 0
    eager_reasons: dict = field(default_factory=dict)


class CudaGraph:
    """One captured encode: capture(fn) runs fn under torch.cuda.graph and returns its static output; replay() reruns
    the recorded kernels, rewriting that output."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn):
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self):
        self.graph.replay()


class EagerGraph:
    """The same contract run eagerly: replay() calls fn again and writes into the output capture() returned. Lets the
    bucketing, buffer and fallback logic run (and be tested) where there is no CUDA."""

    def __init__(self, pool=None):
        self.fn = self.out = None

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


class GraphRunner:
    def __init__(self, model, token_buckets=DEFAULT_BUCKETS, max_seqs: int = 256, max_seqlen: int | None = None,
                 graph_class=None):
        buckets = tuple(sorted(set(int(b) for b in token_buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"token_buckets must be positive token counts, got {token_buckets!r}")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs!r}")
        weight = model.embeddings.word_embeddings.weight
        if graph_class is None:
            if weight.device.type != "cuda":
                raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {weight.device}")
            graph_class = CudaGraph
        if model.training:
            raise ValueError("CUDA graphs capture inference: call model.eval() first (dropout draws new masks)")
        self.model = model
        self.buckets = buckets
        self.max_seqs = max_seqs
        self.max_seqlen = min(max_seqlen or model.embeddings.max_length, model.embeddings.max_length)
        # Every bucket's backends are resolved now, "auto" measured included, before anything is captured.
        self.ops = {b: model.resolve_ops(needs_grad=False, tokens=b, max_seqlen=self.max_seqlen) for b in buckets}
        if any("attention" not in run.triton for run in self.ops.values()):
            raise ValueError("CUDA graphs need attention on its Triton kernel (the PyTorch twin loops over sequence "
                             "lengths on the host); set kernels 'triton' for attention (or 'auto', where it wins)")
        self.stats = GraphStats()
        device, T = weight.device, buckets[-1]
        # Static inputs, shared by every bucket's graph (each reads a prefix of the token buffers).
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.token_type_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(T, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        pool = torch.cuda.graph_pool_handle() if graph_class is CudaGraph else None
        self.graphs, self.outputs = {}, {}
        before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        start = time.perf_counter()
        with torch.inference_mode():
            for bucket in reversed(buckets):  # largest first: the smaller graphs reuse its pool blocks
                self._capture(bucket, graph_class, pool)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stats.capture_s = time.perf_counter() - start
        self.stats.pool_bytes = (torch.cuda.memory_reserved(device) - before) if device.type == "cuda" else 0

    def _encode(self, bucket: int):
        layout = TokenLayout(self.cu_seqlens, self.max_seqlen, bucket, None, None, self.max_seqs, self.max_seqlen)
        x, _, _ = self.model.encode(self.input_ids[:bucket], self.token_type_ids[:bucket], self.position_ids[:bucket],
                                    layout, self.ops[bucket])
        return x

    def _example_layout(self, bucket: int):
        """Sequences of max_seqlen tokens filling the bucket: the warm-up's attention autotunes on real work."""
        lengths = [min(self.max_seqlen, bucket - start) for start in range(0, bucket, self.max_seqlen)]
        ends = torch.tensor(lengths[:self.max_seqs], dtype=torch.int32).cumsum(0)
        self.cu_seqlens.zero_()
        self.cu_seqlens[1:len(ends) + 1].copy_(ends)
        self.cu_seqlens[len(ends) + 1:].fill_(int(ends[-1]))

    def _capture(self, bucket: int, graph_class, pool):
        self._example_layout(bucket)
        if graph_class is CudaGraph:  # warm-up on a side stream: autotuning and lazy init happen here, not captured
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._encode(bucket)
            torch.cuda.current_stream().wait_stream(stream)
        graph = graph_class(pool)
        self.outputs[bucket] = graph.capture(lambda: self._encode(bucket))
        self.graphs[bucket] = graph
        self.stats.captures += 1

    def bucket_for(self, layout: TokenLayout) -> tuple[int | None, str | None]:
        """(the bucket a layout replays in, None) or (None, why it runs eagerly)."""
        if layout.num_seqs > self.max_seqs:
            return None, f"more than max_seqs={self.max_seqs} sequences"
        if layout.max_seqlen > self.max_seqlen:
            return None, f"a sequence longer than max_seqlen={self.max_seqlen}"
        bucket = next((b for b in self.buckets if b >= layout.num_tokens), None)
        if bucket is None:
            return None, f"more than {self.buckets[-1]} tokens (the largest bucket)"
        return bucket, None

    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                 inputs_embeds=None, return_dict=None, cu_seqlens=None, max_seqlen=None, **kwargs):
        """model(...)'s call and outputs (no output_hidden_states / output_attentions: a graph keeps only the last
        hidden state)."""
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(name, None):
                raise ValueError(f"{name} is not available from CUDA graphs; call the model itself")
        model = self.model
        with torch.inference_mode():
            batch = prepare(model, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, False,
                            cu_seqlens, max_seqlen, **kwargs)
            layout, padded = batch.layout, batch.why_padded(False)
            if layout is None:
                bucket, why = None, padded or "padded rows (padding_free=False)"
            elif batch.inputs_embeds is not None:
                bucket, why = None, "inputs_embeds"
            else:
                bucket, why = self.bucket_for(layout)
            if bucket is None:
                self.stats.eager_calls += 1
                self.stats.eager_reasons[why] = self.stats.eager_reasons.get(why, 0) + 1
                # resolved as the model's own forward resolves it: a custom mask keeps attention off the kernel
                x, _, _ = model.encode(batch.input_ids, batch.token_type_ids, batch.position_ids, batch.attn,
                                       model.resolve_ops(False, padded, *batch.size), batch.inputs_embeds)
            else:
                T, n = layout.num_tokens, layout.num_seqs
                self.input_ids[:T].copy_(batch.input_ids)
                self.token_type_ids[:T].copy_(batch.token_type_ids)
                self.position_ids[:T].copy_(batch.position_ids)
                for buffer in (self.input_ids, self.token_type_ids, self.position_ids):
                    buffer[T:bucket].zero_()  # spare tokens: valid ids, in no sequence
                self.cu_seqlens[:n + 1].copy_(layout.cu_seqlens)
                self.cu_seqlens[n + 1:].fill_(T)  # spare sequence slots: empty
                self.graphs[bucket].replay()
                self.stats.replays += 1
                x = self.outputs[bucket][:T].clone()  # the static output is rewritten by the next replay
            out = model.finish(batch, x, None, None, False, False)
        return out if return_dict is None or return_dict else out.to_tuple()
