"""Adapters on fastbert's linear layers: PEFT LoRA (without importing peft), and Jina-Embeddings-v3's task adapters.

PEFT wraps a target nn.Linear in a module that keeps the original as `base_layer` and adds a low-rank path:
y = base_layer(x) + scaling * B(A(dropout(x))). fastbert keeps query/key/value's base layers in its one fused QKV
GEMM and adds each wrapped part's low-rank path to that GEMM's output (`lora_delta`); every other wrapped linear is
called as the module it is.

Task adapters (`TaskLoRA`) are data on the layer, one low-rank pair per task stacked: each sequence picks its task
(`adapter_mask`), and each token adds its own task's low-rank term to the base GEMM's output, which stays one GEMM
over all tokens whatever the tasks.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mask import tracing


def base_layer(module: nn.Module) -> nn.Module:
    """The layer an adapter wraps (PEFT's get_base_layer), or the module itself."""
    get = getattr(module, "get_base_layer", None)
    return get() if get is not None and "base_layer" in module._modules else module


def is_plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def lora_delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """What a PEFT LoRA layer adds to its base layer's output for input x [T, in] (None: nothing, the module is a
    plain linear, its adapters are disabled or merged into the base weight). Plain LoRA only: a variant (DoRA, ...)
    rescales the base output itself, which the fused projection cannot do; it is refused, naming the way out."""
    if "base_layer" not in module._modules:
        return None
    lora_A = getattr(module, "lora_A", None)
    if lora_A is None:
        raise NotImplementedError(f"{type(module).__name__} wraps a query/key/value projection; fastbert's fused QKV "
                                  f"takes LoRA adapters only (merge the adapter first, or fastbert.restore the model)")
    if module.disable_adapters:
        if module.merged:
            module.unmerge()  # what PEFT's own forward does
        return None
    if module.merged:
        return None
    delta = None
    variants = getattr(module, "lora_variant", {})
    for name in module.active_adapters:
        if name not in lora_A:
            continue
        if name in variants or getattr(module, "use_dora", {}).get(name):
            raise NotImplementedError(f"adapter {name!r} is a LoRA variant ({type(variants.get(name)).__name__}) on a "
                                      f"query/key/value projection; fastbert adds plain LoRA's x·A·B to its fused QKV "
                                      f"GEMM only (merge_and_unload() first, or fastbert.restore the model)")
        A, B = lora_A[name], module.lora_B[name]
        h = x.to(A.weight.dtype)
        d = B(A(module.lora_dropout[name](h))) * module.scaling[name]
        delta = d if delta is None else delta + d
    return delta


# --------------------------------------------------------------------------------------------------------------------
# Task adapters (Jina-Embeddings-v3): one low-rank pair per task on every linear and embedding table, the task chosen
# per sequence. docs/model.md ("Task adapters") says how the Hub's checkpoint holds them and how fastbert runs them.
# --------------------------------------------------------------------------------------------------------------------
NO_TASK = -1  # an adapter_mask entry that selects no adapter: the sequence runs on the base weights


class TaskLoRA(nn.Module):
    """The task adapters of one linear or embedding table, stacked one slice per task, as the checkpoint holds them:

        linear W [out, in]:        lora_A [tasks, rank, in],   lora_B [tasks, out, rank]    W_t = W + s B_t A_t
        embedding E [rows, dim]:   lora_A [tasks, rows, rank], lora_B [tasks, rank, dim]    E_t = E + s A_t B_t

    with s = lora_alpha / rank. Nothing is merged: a token of task t gets its linear's base output plus
    s (x A_t^T) B_t^T. `down` computes x's low-rank coordinates for every task at once ([T, in] x [in, tasks * rank],
    one small GEMM whatever the tasks) and keeps each token's own task's columns (`select`, which holds s there and 0
    elsewhere); `up` [tasks * rank, out] maps them back, so down(x) @ up is the token's own task's term."""

    def __init__(self, lora_A_shape: tuple, lora_B_shape: tuple, embedding: bool):
        super().__init__()
        self.embedding = embedding
        self.lora_A = nn.Parameter(torch.empty(lora_A_shape))
        self.lora_B = nn.Parameter(torch.empty(lora_B_shape))
        self._widened = None  # (what it was built from, [W | up^T | 0]): see `widened`

    @property
    def tasks(self) -> int:
        return self.lora_A.shape[0]

    @property
    def rank(self) -> int:
        return self.lora_A.shape[2] if self.embedding else self.lora_A.shape[1]

    def down(self, x: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """[T, in] (an embedding: ids [T]) -> [T, tasks * rank], zero outside each token's task, scaled by s."""
        A = self.lora_A
        if self.embedding:  # the ids' rows of every task's A: [tasks, T, rank] -> [T, tasks * rank]
            low = A[:, x].transpose(0, 1).reshape(x.shape[0], -1)
        else:
            low = F.linear(x, A.reshape(-1, A.shape[-1]))                     # [T, in] x [in, tasks * rank]
        return low * select

    def up(self) -> torch.Tensor:
        """[tasks * rank, out]: row t * rank + j is B_t's column j (an embedding's: B_t's row j)."""
        B = self.lora_B
        return B.reshape(-1, B.shape[-1]) if self.embedding else B.transpose(1, 2).reshape(-1, B.shape[1])

    def add_delta(self, base: torch.Tensor, x: torch.Tensor, select: torch.Tensor, in_place: bool = False):
        """base [T, out] + what each token's task adds to the module's output for input x, down(x) @ up, as one addmm
        (in_place: into base, where autograd records nothing)."""
        if in_place:
            return base.addmm_(self.down(x, select), self.up())
        return torch.addmm(base, self.down(x, select), self.up())

    def widen(self, x: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """[x | down(x) | 0] [T, in + k]: with `widened` ([W | up^T | 0]), x @ W_t^T as one GEMM over a longer K, for
        a linear whose output goes through a nonlinearity inside a fused op before anything could be added to it
        (the MLP's first linear: act(x W_1^T + b_1)). k: tasks * rank, rounded up so that in + k is a multiple of 16
        (Triton specialises the GEMM on a K divisible by 16; the padding columns are 0 on both sides)."""
        low = self.down(x, select)
        return torch.cat([x, low, low.new_zeros(x.shape[0], self._padding(x.shape[1]))], dim=1)

    def widened(self, weight: torch.Tensor) -> torch.Tensor:
        """[W | up^T | 0] [out, in + k] (see `widen`), built once and kept while W and lora_B are the tensors they
        were, at the versions they were (a move, a cast, a load or an in-place update builds it again: in place where
        the shape allows, so that a CUDA graph captured over it reads the new values). It costs one more copy of W."""
        B = self.lora_B
        if tracing():  # a trace records the concatenation (no data pointers to key a cache on)
            k = B.shape[0] * B.shape[2]
            return torch.cat([weight, B.permute(1, 0, 2).reshape(weight.shape[0], k),
                              weight.new_zeros(weight.shape[0], self._padding(weight.shape[1]))], dim=1)
        key = (weight.data_ptr(), _version(weight), B.data_ptr(), _version(B), weight.dtype, weight.device)
        if self._widened is not None and self._widened[0] == key:
            return self._widened[1]
        k = B.shape[0] * B.shape[2]
        out, fan_in = weight.shape
        old = None if self._widened is None else self._widened[1]
        shape = (out, fan_in + k + self._padding(fan_in))
        fresh = old if old is not None and old.shape == shape and old.dtype == weight.dtype \
            and old.device == weight.device else weight.new_empty(shape)
        with torch.no_grad():
            fresh[:, :fan_in] = weight
            fresh[:, fan_in:fan_in + k] = B.permute(1, 0, 2).reshape(out, k)  # = up().T
            fresh[:, fan_in + k:] = 0
        self._widened = (key, fresh)
        return fresh

    def _padding(self, fan_in: int) -> int:
        k = self.tasks * self.rank
        return -(fan_in + k) % 16

    def _apply(self, fn, recurse=True):
        self._widened = None  # a move or cast: built again from the new tensors
        return super()._apply(fn, recurse)


def _version(t: torch.Tensor) -> int | None:
    """t's in-place update count; None for a tensor made under inference_mode (it keeps none, and cannot be updated
    in place outside it)."""
    return None if t.is_inference() else t._version


def task_select(tasks: torch.Tensor, num_tasks: int, rank: int, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """[T] each token's task (NO_TASK: none) -> [T, num_tasks * rank]: `scaling` in the columns of the token's task
    (column c belongs to task c // rank), 0 elsewhere. Built once per forward; every TaskLoRA.down multiplies by it."""
    owner = torch.arange(num_tasks * rank, device=tasks.device) // rank
    return (tasks[:, None] == owner).to(dtype) * scaling


def per_token(adapter_mask: torch.Tensor, batch) -> torch.Tensor:
    """adapter_mask [n] (one task per sequence) -> each token's task, in the batch's token order: [T] packed, [B * S]
    for padded rows. Device work only (the sequence lengths of packed input come from cu_seqlens)."""
    layout = batch.layout
    if batch.output != "padded":  # packed input: sequences back to back
        lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(adapter_mask.long(), lengths, output_size=layout.num_tokens)
    B, S = batch.shape
    rows = adapter_mask.long()[:, None].expand(B, S)
    if layout is None:  # padded rows (output_attentions, a custom mask, padding_free=False, tracing)
        return rows.reshape(B * S)
    flat = rows.reshape(B * S)
    return flat if layout.indices is None else flat.index_select(0, layout.indices)


def pooled_tasks(adapter_mask: torch.Tensor, batch) -> torch.Tensor:
    """The task of each token the pooler reads: every sequence's first; where sequences are packed inside rows
    (transformers' packed forms), each row's token 0."""
    return per_token(adapter_mask, batch)[::batch.shape[1]] if batch.output == "rows" else adapter_mask


def check_adapter_mask(model, adapter_mask, num_seqs: int, inputs_embeds) -> None:
    """adapter_mask as Jina's remote code takes it: one task index per sequence, [B] for padded input, [n] for packed
    input; NO_TASK (-1) runs a sequence on the base weights. Values are range-checked in prepare's one host read."""
    tasks = model.task_names
    if not tasks:
        raise ValueError("adapter_mask was given, but this model has no task adapters (its checkpoint carries none)")
    if not isinstance(adapter_mask, torch.Tensor) or adapter_mask.dim() != 1 or adapter_mask.is_floating_point() \
            or adapter_mask.dtype == torch.bool:
        raise TypeError(f"adapter_mask must be a 1-D integer tensor of task indices, one per sequence, got "
                        f"{getattr(adapter_mask, 'dtype', type(adapter_mask).__name__)} "
                        f"{tuple(getattr(adapter_mask, 'shape', ()))}")
    if adapter_mask.shape[0] != num_seqs:
        raise ValueError(f"adapter_mask has {adapter_mask.shape[0]} entries but the input has {num_seqs} sequences "
                         f"(one task index per sequence)")
    device = model.embeddings.word_embeddings.weight.device
    if adapter_mask.device != device:
        raise ValueError(f"adapter_mask is on {adapter_mask.device} but the model is on {device}; move it with "
                         f".to({str(device)!r})")
    if inputs_embeds is not None:
        raise ValueError("adapter_mask needs input_ids: the word embeddings' task adapters are read by token id "
                         "(inputs_embeds has none)")
    if model.training:
        raise NotImplementedError("task adapters run for inference only (eval mode): call model.eval(); training "
                                  "them is not implemented")


def task_index(model, task: str) -> int:
    """The index of a task name in the model's tasks (its config's lora_adaptations), else a ValueError."""
    if not model.task_names:
        raise ValueError(f"task {task!r}: this model has no task adapters (its checkpoint carries none)")
    if task not in model.task_names:
        raise ValueError(f"unknown task {task!r}; this model's tasks are {', '.join(map(repr, model.task_names))}")
    return model.task_names.index(task)


def adapter_mask(model, tasks) -> torch.Tensor:
    """Per-sequence task names (None: no adapter) -> the adapter_mask tensor [n] on the model's device; None when no
    sequence names a task (the model as loaded)."""
    if all(t is None for t in tasks):
        return None
    indices = [NO_TASK if t is None else task_index(model, t) for t in tasks]
    return torch.tensor(indices, dtype=torch.long, device=model.embeddings.word_embeddings.weight.device)


def attach_task_adapters(model, state: dict) -> None:
    """A TaskLoRA on its holder for each adapter of `state` ({"<holder>.task_adapters.<name>.lora_A" / "lora_B":
    tensor}: a checkpoint's, in the model's names; loading.task_adapter_layout), shaped as the checkpoint's tensors,
    on the model's device (meta while loading: load_state_dict fills them). Every linear and embedding table the
    model runs must have one (a pooler's only where the model has a pooler), all with the same tasks and rank, each
    shaped for its module; the config names the tasks (lora_adaptations, in adapter_mask's order) and gives
    lora_alpha (scaling = lora_alpha / rank; 1 where absent, the default of Jina's config class)."""
    modules = _adapted_modules(model)
    pairs = {}
    for key, tensor in state.items():
        holder, part = key.rsplit(".", 1)
        if holder.startswith("pooler.") and model.pooler is None:
            continue  # the pooler's adapter: skipped with the pooler (the loader says so)
        pairs.setdefault(holder, {})[part] = tensor
    missing, unexpected = sorted(set(modules) - set(pairs)), sorted(set(pairs) - set(modules))
    incomplete = sorted(h for h, p in pairs.items() if set(p) != {"lora_A", "lora_B"})
    if missing or unexpected or incomplete:
        raise ValueError(f"the checkpoint's task adapters do not fit the model: adapters missing for "
                         f"{missing or 'none'}; adapters on modules the model does not run: {unexpected or 'none'}; "
                         f"without both lora_A and lora_B: {incomplete or 'none'}")
    sizes = {(p["lora_A"].shape[0], p["lora_A"].shape[2 if modules[h][1] else 1]) for h, p in pairs.items()}
    if len(sizes) != 1:
        raise ValueError(f"the checkpoint's task adapters differ in their (tasks, rank): {sorted(sizes)}")
    (tasks, rank), = sizes
    for holder, (shape, embedding) in modules.items():
        A, B = pairs[holder]["lora_A"].shape, pairs[holder]["lora_B"].shape
        rows, cols = shape  # a linear's [out, in]; a table's [rows, dim]
        want = ((tasks, rows, rank), (tasks, rank, cols)) if embedding else ((tasks, rank, cols), (tasks, rows, rank))
        if (tuple(A), tuple(B)) != want:
            raise ValueError(f"{holder}: lora_A {tuple(A)} and lora_B {tuple(B)} do not fit its module's weight "
                             f"{tuple(shape)} (expected {want[0]} and {want[1]})")
    config = model.config
    names = getattr(config, "lora_adaptations", None)
    if not isinstance(names, (list, tuple)) or len(names) != tasks or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != tasks:
        raise ValueError(f"the checkpoint holds task adapters for {tasks} tasks, but the config's lora_adaptations "
                         f"is {names!r}: it must list {tasks} distinct task names, in the adapters' order")
    if getattr(config, "lora_rank", rank) != rank:
        raise ValueError(f"the config says lora_rank={config.lora_rank}, the checkpoint's adapters have rank {rank}")
    alpha = getattr(config, "lora_alpha", 1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"the config's lora_alpha must be a number, got {alpha!r}")
    device = model.embeddings.word_embeddings.weight.device
    with torch.device(device):
        for holder in dict.fromkeys(h.rsplit(".task_adapters.", 1)[0] for h in modules):
            names_here = [h for h in modules if h.startswith(holder + ".task_adapters.")]
            model.get_submodule(holder).add_module("task_adapters", nn.ModuleDict({
                h.rsplit(".", 1)[1]: TaskLoRA(tuple(pairs[h]["lora_A"].shape), tuple(pairs[h]["lora_B"].shape),
                                              embedding=modules[h][1]) for h in names_here}))
    model.task_names, model.task_rank, model.task_scaling = tuple(names), rank, alpha / rank


def _adapted_modules(model) -> dict:
    """"<holder>.task_adapters.<name>" -> (the adapted weight's shape, whether it is an embedding table) for every
    module a Jina-Embeddings-v3 model runs task adapters on: the word and token type tables, each layer's fused q/k/v,
    attention output and MLP linears, the pooler's dense."""
    embeddings = model.embeddings
    found = {"embeddings.task_adapters.word_embeddings": (tuple(embeddings.word_embeddings.weight.shape), True)}
    if embeddings.token_type_embeddings is not None:
        found["embeddings.task_adapters.token_type_embeddings"] = (
            tuple(embeddings.token_type_embeddings.weight.shape), True)
    layers = model.family.layers
    for i, layer in enumerate(model.layers):
        parts = layer.self_attention.parts()
        found[f"{layers}.{i}.task_adapters.qkv"] = ((sum(p.shape[0] for p in parts[:3]), parts[0].shape[1]), False)
        for role in ("attn_out", "ffn_in", "ffn_out"):
            found[f"{layers}.{i}.task_adapters.{role}"] = (tuple(layer.module(role).weight.shape), False)
    if model.pooler is not None:
        found["pooler.task_adapters.dense"] = (tuple(model.pooler.dense.weight.shape), False)
    return found
