"""CUDA graphs for BertModel.encode over packed token-count buckets, and the default path that uses them.

At small batch a BERT forward is bound by the host: ~100 kernel launches, each a few microseconds of Python and
driver time, for a few microseconds of GPU work each. A CUDA graph replays all of them with one launch. Graphs need
static shapes, and the packed layout makes the token count the only shape that matters: a call with T real tokens in
n sequences runs the graph captured for the smallest bucket >= T, its inputs copied into static buffers (the spare
tokens belong to no sequence, the spare sequence slots are empty), and the attention grid covers the bucket's
max_seqlen queries for its max_seqs sequences whatever their lengths. So any mix of lengths replays without a new
capture or a recompile; a call beyond the largest bucket, with more than max_seqs sequences or a sequence longer
than max_seqlen runs eagerly. A bucket is captured the first time a call needs it.

    runner = model.cuda_graphs(token_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), max_seqs=256)
    out = runner(input_ids=ids, attention_mask=mask)      # same outputs as model(...)
    runner.stats                                          # captures, pool bytes, replays, eager calls and why

`Graphed(model)` is what runs by default in fastbert.encode / SentenceEncoder, inside what fastbert.optimize
swaps in, and in `python -m fastbert`: the model's call, through a runner where graphs are safe (CUDA, inference,
no extra outputs, attention on its kernel), the model's own forward everywhere else.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import dispatch
from .adapters import NO_TASK, per_token
from .inputs import prepare
from .layout import TokenLayout

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
# The default path's runner. max_captures is its memory bound: the graphs of at most this many buckets (the first
# ones used) share one pool; a bucket used after that runs eagerly.
DEFAULT_OPTIONS = {"token_buckets": DEFAULT_BUCKETS, "max_seqs": 256, "max_captures": 4}


@dataclass
class GraphStats:
    captures: int = 0
    capture_s: float = 0.0
    pool_bytes: int = 0  # device memory the graphs' shared pool took when they were captured (CUDA)
    replays: int = 0
    eager_calls: int = 0
    eager_reasons: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)  # bucket -> the error its capture raised (it runs eagerly)

    def eager(self, why: str) -> None:
        self.eager_calls += 1
        self.eager_reasons[why] = self.eager_reasons.get(why, 0) + 1

    def describe(self) -> str:
        """One line: what replayed, what was captured, what ran eagerly and why."""
        reasons = "; ".join(f"{why}: {n}" for why, n in self.eager_reasons.items())
        return (f"{self.replays} replays, {self.captures} captures ({self.capture_s:.2f} s, pool "
                f"{self.pool_bytes / 2**20:.1f} MiB), {self.eager_calls} eager calls" + (f" ({reasons})" if reasons
                                                                                        else ""))


class CudaGraph:
    """One captured encode: capture(fn) warms fn up on a side stream (autotuning and lazy initialisation happen
    there, not in the graph), runs it under torch.cuda.graph and returns its static output; replay() reruns the
    recorded kernels, rewriting that output. `bytes`: what the capture added to the pool."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.bytes = 0

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    def capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        before = torch.cuda.memory_reserved()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        self.bytes = torch.cuda.memory_reserved() - before
        return out

    def replay(self):
        self.graph.replay()


class _Tape(TorchDispatchMode):
    """What one run of fn does at the ATen level: the ops with their non-tensor arguments, and the tensors it reads
    from outside itself (storages it did not create: weights, static buffers), kept alive so that an address cannot
    be reused by another tensor."""

    def __init__(self):
        super().__init__()
        self.ops, self.outside, self.made = [], {}, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host read of a tensor's value (.item(), .tolist(), int(t)) inside the captured "
                               "encode: a CUDA graph cannot capture it")
        leaves = tree_flatten((args, kwargs))[0]
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.made:
                    self.outside.setdefault(ptr, t)
        self.ops.append((func, tuple(x for x in leaves if not isinstance(x, (torch.Tensor, torch.UntypedStorage)))))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in self.outside:
                self.made.add(t.untyped_storage().data_ptr())
        return out


class EagerGraph:
    """CUDAGraph's contract run eagerly, so that the bucketing, buffer and fallback logic run (and are tested) where
    there is no CUDA. It is as strict as a graph about what replay() reads: it runs fn again and writes into the
    output capture() returned, but raises unless that run is the captured one: the same ops with the same non-tensor
    arguments, reading the same tensors from outside fn (a graph reads the captured addresses, so inputs must be
    copied into the static buffers, never rebound), and no host read of a tensor's value."""

    bytes = 0

    def __init__(self, pool=None):
        self.fn = self.out = self.tape = None

    @staticmethod
    def new_pool():
        return None

    def _run(self):
        tape = _Tape()
        with torch.inference_mode(self.modes[0]), torch.set_grad_enabled(self.modes[1]), tape:
            out = self.fn()
        return out, tape

    def capture(self, fn):
        self.fn, self.modes = fn, (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        fn()  # the warm-up CudaGraph runs too: first-call work (autotuning, caches) stays out of the tape
        self.out, self.tape = self._run()
        return self.out

    def replay(self):
        out, tape = self._run()
        captured = self.tape
        if len(tape.ops) != len(captured.ops) or any(a != b for a, b in zip(tape.ops, captured.ops)):
            step = next((i for i, (a, b) in enumerate(zip(tape.ops, captured.ops)) if a != b),
                        min(len(tape.ops), len(captured.ops)))
            raise RuntimeError(f"EagerGraph.replay: the encode ran other ops than the captured one (from op {step}: "
                               f"{tape.ops[step:step + 1]} where the capture ran {captured.ops[step:step + 1]}); a "
                               f"CUDA graph replays the captured ones")
        new = [t for ptr, t in tape.outside.items() if ptr not in captured.outside]
        if new:
            raise RuntimeError(f"EagerGraph.replay: the encode read {len(new)} tensor(s) the capture did not (first: "
                               f"{new[0].dtype} {tuple(new[0].shape)}); a CUDA graph reads the captured tensors' "
                               f"memory, so new inputs must be copied into the static buffers")
        self.out.copy_(out)


# Device type -> the graph class the default path (Graphed) captures with; on any other device it runs eagerly.
GRAPH_CLASSES = {"cuda": CudaGraph}

# Bumped whenever any module registers a parameter, buffer or submodule (a replaced weight or embedding module):
# a runner then compares its model's tensors in full, which is too slow to do on every call.
_REGISTRATIONS = [0]


def _count_registration(*args):
    _REGISTRATIONS[0] += 1


def _watch_registrations():
    if not _REGISTRATIONS[0]:
        _REGISTRATIONS[0] = 1
        for register in (torch.nn.modules.module.register_module_parameter_registration_hook,
                         torch.nn.modules.module.register_module_buffer_registration_hook,
                         torch.nn.modules.module.register_module_module_registration_hook):
            register(_count_registration)


_TWIN_ATTENTION = "attention runs its PyTorch twin (it reads the sequence lengths on the host, which a graph cannot)"


class GraphRunner:
    """Calls like the model; replays a graph per token bucket, captured on first use.

    strict (model.cuda_graphs()): every bucket's backends are resolved now ("auto" measured included) and attention
    must run its Triton kernel in all of them, else ValueError. strict=False (the default path): a bucket is resolved
    when first used, and one whose attention runs the twin stays eager (one warning).
    max_captures: at most this many buckets get a graph; a new bucket after that runs eagerly (None: no limit)."""

    def __init__(self, model, token_buckets=DEFAULT_BUCKETS, max_seqs: int = 256, max_seqlen: int | None = None,
                 graph_class=None, *, strict: bool = True, max_captures: int | None = None,
                 stats: GraphStats | None = None):
        buckets = tuple(sorted(set(int(b) for b in token_buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"token_buckets must be positive token counts, got {token_buckets!r}")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs!r}")
        if max_captures is not None and max_captures < 0:
            raise ValueError(f"max_captures must be >= 0 or None, got {max_captures!r}")
        weight = model.embeddings.word_embeddings.weight
        if graph_class is None:
            if weight.device.type != "cuda":
                raise ValueError(f"CUDA graphs need the model on a CUDA device; it is on {weight.device}")
            graph_class = CudaGraph
        if model.training:
            raise ValueError("CUDA graphs capture inference: call model.eval() first (dropout draws new masks)")
        self.model, self.buckets, self.graph_class = model, buckets, graph_class
        self.max_seqs, self.strict, self.max_captures = max_seqs, strict, max_captures
        self.max_seqlen = min(max_seqlen or model.embeddings.max_length, model.embeddings.max_length)
        self.stats = stats if stats is not None else GraphStats()
        _watch_registrations()
        self._reset()

    def _reset(self):
        """Buffers, backend choices and graphs for the model's weights as they are now (after a move or a cast the
        recorded kernels would read freed memory, so everything is made again)."""
        model = self.model
        self.tensors = (*model.parameters(), *model.buffers())
        self.pointers = [t.data_ptr() for t in self.tensors]
        self.kernels, self.registrations = tuple(model.kernels.values()), _REGISTRATIONS[0]
        self.ops = {}
        if self.strict:
            self.ops = {b: self._resolve(b) for b in self.buckets}
            if any("attention" not in run.triton for run in self.ops.values()):
                raise ValueError("CUDA graphs need attention on its Triton kernel (the PyTorch twin loops over "
                                 "sequence lengths on the host); set kernels 'triton' for attention (or 'auto', "
                                 "where it wins)")
        device, T = model.embeddings.word_embeddings.weight.device, self.buckets[-1]
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, whatever mode the first call runs in
            # Static inputs, shared by every bucket's graph (each reads a prefix of the buffers).
            self.input_ids = torch.zeros(T, dtype=torch.long, device=device)
            self.token_type_ids = torch.zeros(T, dtype=torch.long, device=device)
            self.position_ids = torch.zeros(T, dtype=torch.long, device=device)
            self.cu_seqlens = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
            # each token's task where the model has task adapters: its graphs always run them (-1 selects none,
            # which adds exact zeros), so one graph per bucket serves every mix of tasks
            self.tasks = torch.full((T,), NO_TASK, dtype=torch.long, device=device) if model.task_names else None
        self.pool = self.graph_class.new_pool()
        self.graphs, self.outputs, self.eager_buckets = {}, {}, {}
        self.stats.pool_bytes = 0  # the old pool goes with the old graphs

    def _stale(self) -> bool:
        """The recorded kernels no longer fit the model: a weight moved, was cast or replaced, or the requested
        backends changed."""
        model = self.model
        if _REGISTRATIONS[0] != self.registrations:
            self.registrations = _REGISTRATIONS[0]
            current = (*model.parameters(), *model.buffers())
            if len(current) != len(self.tensors) or any(a is not b for a, b in zip(current, self.tensors)):
                return True
        return [t.data_ptr() for t in self.tensors] != self.pointers or tuple(model.kernels.values()) != self.kernels

    def _limits(self, bucket: int) -> tuple[int, int]:
        """(sequences, longest sequence) a bucket's graph covers: no more than its tokens, which keeps the attention
        grid of a small bucket small."""
        return min(self.max_seqs, bucket), min(self.max_seqlen, bucket)

    def _resolve(self, bucket: int) -> dispatch.Ops:
        return self.model.resolve_ops(needs_grad=False, tokens=bucket, max_seqlen=self._limits(bucket)[1])

    def _encode(self, bucket: int):
        seqs, longest = self._limits(bucket)
        layout = TokenLayout(self.cu_seqlens[:seqs + 1], longest, bucket, None, None, seqs, longest)
        x, _, _ = self.model.encode(self.input_ids[:bucket], self.token_type_ids[:bucket], self.position_ids[:bucket],
                                    layout, self.ops[bucket], tasks=None if self.tasks is None else self.tasks[:bucket])
        return x

    def _example_layout(self, bucket: int):
        """Sequences of the longest length filling the bucket: the warm-up's attention autotunes on real work."""
        seqs, longest = self._limits(bucket)
        lengths = [min(longest, bucket - start) for start in range(0, bucket, longest)]
        ends = torch.tensor(lengths[:seqs], dtype=torch.int32).cumsum(0)
        self.cu_seqlens.zero_()
        self.cu_seqlens[1:len(ends) + 1].copy_(ends)
        self.cu_seqlens[len(ends) + 1:].fill_(int(ends[-1]))

    def _load(self, batch, bucket: int) -> None:
        """Copy a call's packed inputs into the static buffers the graphs read (never rebind them: a graph reads
        the captured addresses)."""
        layout = batch.layout
        T, n = layout.num_tokens, layout.num_seqs
        self.input_ids[:T].copy_(batch.input_ids)
        if batch.token_type_ids is not None:  # DistilBERT, MPNet have none: their embeddings never read the buffer
            self.token_type_ids[:T].copy_(batch.token_type_ids)
        self.position_ids[:T].copy_(batch.position_ids)
        for buffer in (self.input_ids, self.token_type_ids, self.position_ids):
            buffer[T:bucket].zero_()  # spare tokens: valid ids, in no sequence
        if self.tasks is not None:
            if batch.adapter_mask is None:
                self.tasks[:T].fill_(NO_TASK)
            else:
                self.tasks[:T].copy_(per_token(batch.adapter_mask, batch))
            self.tasks[T:bucket].fill_(NO_TASK)
        self.cu_seqlens[:n + 1].copy_(layout.cu_seqlens)
        self.cu_seqlens[n + 1:].fill_(T)  # spare sequence slots: empty

    def _graph_for(self, bucket: int) -> str | None:
        """Capture `bucket` if it is not yet; None when its graph is ready, else why it runs eagerly."""
        if bucket in self.graphs:
            return None
        if bucket in self.eager_buckets:
            return self.eager_buckets[bucket]
        if self.max_captures is not None and len(self.graphs) >= self.max_captures:
            return f"max_captures={self.max_captures} buckets captured already"
        if bucket not in self.ops:
            self.ops[bucket] = self._resolve(bucket)
        if "attention" not in self.ops[bucket].triton:
            if not any(why == _TWIN_ATTENTION for why in self.eager_buckets.values()):
                warnings.warn(f"fastbert: no CUDA graphs where {_TWIN_ATTENTION}; the model runs eagerly there "
                              f"(attention asked for {self.model.kernels['attention']!r}); said once", stacklevel=4)
            self.eager_buckets[bucket] = _TWIN_ATTENTION
            return _TWIN_ATTENTION
        start = time.perf_counter()
        self._example_layout(bucket)
        graph = self.graph_class(self.pool)
        try:
            with torch.inference_mode(False), torch.no_grad():
                self.outputs[bucket] = graph.capture(lambda: self._encode(bucket))
        except Exception as e:  # noqa: BLE001 - any failure leaves this bucket eager; the call still answers
            error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            warnings.warn(f"fastbert: capturing the CUDA graph of the {bucket}-token bucket failed ({error}); "
                          f"that bucket runs eagerly", stacklevel=4)
            self.stats.failed[bucket] = error
            self.eager_buckets[bucket] = f"the capture of the {bucket}-token bucket failed"
            self.outputs.pop(bucket, None)
            return self.eager_buckets[bucket]
        self.graphs[bucket] = graph
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - start
        self.stats.pool_bytes += graph.bytes
        return None

    def capture(self, buckets=None) -> GraphStats:
        """Capture these buckets (default: all) now rather than on first use, largest first (the smaller graphs reuse
        its pool blocks). A capture that fails warns and leaves its bucket eager, as on first use."""
        unknown = sorted(set(buckets or ()) - set(self.buckets))
        if unknown:
            raise ValueError(f"buckets {unknown} are not among this runner's token_buckets {self.buckets}")
        if self._stale():
            self._reset()
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self._graph_for(bucket)
        return self.stats

    def bucket_for(self, layout: TokenLayout) -> tuple[int | None, str | None]:
        """(the bucket a layout replays in, None) or (None, why it runs eagerly)."""
        if layout.num_seqs > self.max_seqs:
            return None, f"more than max_seqs={self.max_seqs} sequences"
        if layout.max_seqlen > self.max_seqlen:
            return None, f"a sequence longer than max_seqlen={self.max_seqlen}"
        bucket = next((b for b in self.buckets if b >= layout.num_tokens and layout.num_seqs <= self._limits(b)[0]),
                      None)
        if bucket is None:
            return None, f"more than {self.buckets[-1]} tokens (the largest bucket)"
        return bucket, None

    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                 inputs_embeds=None, return_dict=None, cu_seqlens=None, max_seqlen=None, use_cache=None, **kwargs):
        """model(...)'s call and outputs (no output_hidden_states / output_attentions: a graph keeps only the last
        hidden state)."""
        for name in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(name, None):
                raise ValueError(f"{name} is not available from CUDA graphs; call the model itself")
        model = self.model
        if model.training:
            raise ValueError("CUDA graphs capture inference: call model.eval() first (dropout draws new masks)")
        if self._stale():
            self._reset()
        with torch.no_grad():
            batch = prepare(model, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, False,
                            cu_seqlens, max_seqlen, **kwargs)
            layout, padded = batch.layout, batch.why_padded(False)
            if layout is None:
                bucket, why = None, padded or "padded rows (padding_free=False)"
            elif batch.inputs_embeds is not None:
                bucket, why = None, "inputs_embeds"
            else:
                bucket, why = self.bucket_for(layout)
                why = why or self._graph_for(bucket)
            if why is not None:
                self.stats.eager(why)
                # resolved as the model's own forward resolves it: a custom mask keeps attention off the kernel
                tasks = None if batch.adapter_mask is None else per_token(batch.adapter_mask, batch)
                x, _, _ = model.encode(batch.input_ids, batch.token_type_ids, batch.position_ids, batch.attn,
                                       model.resolve_ops(False, padded, *batch.size), batch.inputs_embeds,
                                       tasks=tasks)
            else:
                self._load(batch, bucket)
                self.graphs[bucket].replay()
                self.stats.replays += 1
                x = self.outputs[bucket][:layout.num_tokens].clone()  # rewritten by the next replay
            out = model.finish(batch, x, None, None, False, False)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        return out if return_dict else model.output_tuple(out)


class Graphed:
    """`model(...)` through CUDA graphs where they are safe, the model's own forward everywhere else: what
    fastbert.encode / SentenceEncoder, the modules fastbert.optimize swaps in and `python -m fastbert` run.

    Graphs run for inference calls on a device in GRAPH_CLASSES (CUDA): eval mode, no autograd, no
    output_hidden_states / output_attentions, no inputs_embeds, no custom 3-D/4-D mask, not while tracing, and only
    for buckets where attention runs its Triton kernel. Buckets are captured on first use, at most `max_captures`
    of them (DEFAULT_OPTIONS; the pool they share is `stats.pool_bytes`); a failed capture leaves its bucket eager
    with one warning. A model moved, cast or given new weights after a capture is captured again.
    `stats` counts replays, captures and every eager call by reason."""

    def __init__(self, model, *, forward=None, **options):
        self.model = model
        # the eager call: model(...), or forward(model, ...) for a module whose own forward calls this object
        self.forward = forward
        self.options = options  # GraphRunner's, over DEFAULT_OPTIONS: token_buckets, max_seqs, max_seqlen, ...
        self.stats = GraphStats()
        self.runner = None

    def __getstate__(self):  # a copied or pickled model starts without graphs (they hold device pointers)
        return {**self.__dict__, "runner": None, "stats": GraphStats()}

    def _eager(self, *args, **kwargs):
        return self.model(*args, **kwargs) if self.forward is None else self.forward(self.model, *args, **kwargs)

    def why_eager(self, output_hidden_states, output_attentions, inputs_embeds) -> str | None:
        """Why this call runs the model's forward rather than a graph (None: a graph may serve it)."""
        model, cfg = self.model, self.model.config
        if model.training:
            return "train mode"
        if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
            return "autograd (gradients enabled; run under torch.no_grad() or torch.inference_mode())"
        if output_hidden_states if output_hidden_states is not None else cfg.output_hidden_states:
            return "output_hidden_states"
        if output_attentions if output_attentions is not None else getattr(cfg, "output_attentions", False):
            return "output_attentions"
        if inputs_embeds is not None:
            return "inputs_embeds"
        if model.embeddings.word_embeddings.weight.device.type not in GRAPH_CLASSES:
            self.runner = None  # moved off the GPU: its graphs go too
            return f"no CUDA graphs on {model.embeddings.word_embeddings.weight.device.type}"
        return None

    def __call__(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                 inputs_embeds=None, output_hidden_states=None, output_attentions=None, return_dict=None,
                 use_cache=None, cu_seqlens=None, max_seqlen=None, **kwargs):
        if dispatch.tracing():  # the recorded graph is the model's own forward; nothing counted while recording
            return self._eager(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, output_attentions, return_dict, use_cache, cu_seqlens,
                               max_seqlen, **kwargs)
        why = self.why_eager(output_hidden_states, output_attentions, inputs_embeds)
        if why is not None:
            self.stats.eager(why)
            return self._eager(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, output_attentions, return_dict, use_cache, cu_seqlens,
                               max_seqlen, **kwargs)
        graph_class = GRAPH_CLASSES[self.model.embeddings.word_embeddings.weight.device.type]
        if self.runner is None or self.runner.graph_class is not graph_class:
            self.runner = GraphRunner(self.model, graph_class=graph_class, strict=False, stats=self.stats,
                                      **{**DEFAULT_OPTIONS, **self.options})
        return self.runner(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, return_dict,
                           cu_seqlens, max_seqlen, use_cache, **kwargs)


def graphed(model, enabled: bool = True, **options):
    """What to call instead of `model`: a Graphed(model) when enabled, else the model itself."""
    return Graphed(model, **options) if enabled else model


def stats_of(model_or_call) -> GraphStats | None:
    """The GraphStats of a Graphed call, or of a module that runs one (what fastbert.optimize swaps in); None for a
    plain model."""
    if isinstance(model_or_call, Graphed):
        return model_or_call.stats
    current = getattr(model_or_call, "__dict__", {}).get("graphed")
    return current.stats if isinstance(current, Graphed) else None
