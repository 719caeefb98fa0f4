"""query/key/value as HF's nn.Linear modules over one fused weight: the QKV projection is one GEMM.

Where a family's checkpoints keep q, k and v apart (every post-norm family), the layer holds them at HF's paths
(attention.self.query, ...) under a FusedQKV, whose parameters alias rows of one fused W_qkv [3H, H] and b_qkv [3H]
(docs/contract.md says why one copy of the weights, and what sees three tensors).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import adapters
from ..mask import tracing


class FusedQKV(nn.Module):
    """HF's query/key/value (DistilBERT: q_lin/k_lin/v_lin; MPNet: q/k/v), as HF's nn.Linear modules with HF's
    parameter names, whose weights and biases sit side by side in one fused weight [3H, H] and bias [3H]: the
    projection is one GEMM over them. Each part's parameter has a storage of its own that aliases its rows of the
    fused tensors (`_alias`), so state_dict(), safetensors and transformers' tied-weights checks see three independent
    tensors, while an in-place update (an optimizer step, load_state_dict, PEFT's merge) lands in the fused weight at
    once: one copy of the weights. Where HF's module holds more (DistilBERT's out_lin, MPNet's o), the layer adds it."""

    def __init__(self, hidden: int, names: tuple = ("query", "key", "value"), out_features: int | tuple | None = None,
                 bias: bool = True):
        """out_features: every part's width (default: hidden), or one per part (grouped-query attention: key and
        value narrower than query)."""
        super().__init__()
        self.names = names
        widths = hidden if out_features is None else out_features
        for name, width in zip(names, widths if isinstance(widths, tuple) else (widths,) * len(names), strict=True):
            self.add_module(name, nn.Linear(hidden, width, bias=bias))
        self._fused = None  # (weight [3H, H], bias [3H], the parts' data pointers when packed)
        self.register_load_state_dict_post_hook(lambda module, keys: module.pack())  # assign=True puts new tensors
        self.pack()

    def parts(self) -> tuple:
        """(query.weight, key.weight, value.weight, query.bias, key.bias, value.bias) of the base layers (under a
        PEFT adapter, the layer it wraps)."""
        mods, names = self._modules, self.names
        if len(names) == 2:  # a gated MLP's gate and up projections (FusedPair)
            a, b = mods[names[0]], mods[names[1]]
            if not type(a) is type(b) is nn.Linear:
                a, b = adapters.base_layer(a), adapters.base_layer(b)
            a, b = a._parameters, b._parameters
            return a["weight"], b["weight"], a["bias"], b["bias"]
        q, k, v = mods[names[0]], mods[names[1]], mods[names[2]]
        if not type(q) is type(k) is type(v) is nn.Linear:  # (a plain read first: this runs every forward)
            q, k, v = (adapters.base_layer(m) for m in (q, k, v))
        q, k, v = q._parameters, k._parameters, v._parameters
        return q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"]

    def pack(self) -> None:
        """Put the parts' current values into one fused weight and bias, and point the parts at their rows. A fused
        weight these very parts already alias (a second fastbert model over the same HF modules) is kept."""
        parts = self.parts()
        holder = adapters.base_layer(self._modules[self.names[0]]).__dict__
        record = holder.get("_fastbert_fused")
        if record is not None and record[2] == _pointers(parts):
            self._fused = record
            return
        n = len(self.names)
        with torch.no_grad():
            weight, bias = _cat([p.detach() for p in parts[:n]]), _cat([p for p in parts[n:]])
        for fused, group in ((weight, parts[:n]), (bias, parts[n:])):
            if fused is not None:
                for part, rows in zip(group, fused.split([p.shape[0] for p in parts[:n]], dim=0)):
                    part.data = _alias(rows)
        self._fused = holder["_fastbert_fused"] = (weight, bias, _pointers(parts))

    def fused(self, parts: tuple | None = None, traced: bool | None = None,
              grad: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_qkv [3H, H], b_qkv [3H]) for this forward. Where autograd needs the parts, or a trace records the
        forward, the parts concatenated (a copy: gradients reach HF's own parameters, and the trace reads them);
        otherwise the fused tensors themselves. `parts` / `traced` / `grad`: what the caller knows already (the
        layer's forward: `parts()`, and its plan's `traced` and `grad`)."""
        parts = self.parts() if parts is None else parts
        grad = torch.is_grad_enabled() if grad is None else grad
        if grad and any(p is not None and p.requires_grad for p in parts) or (tracing() if traced is None else traced):
            n = len(self.names)
            return _cat(parts[:n]), _cat(parts[n:])
        fused = self._fused
        if fused is None or fused[2] != _pointers(parts):  # `.data =`, a replaced module, ...
            self.pack()
            fused = self._fused
        return fused[0], fused[1]

    def _packed(self, parts) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fused(parts, traced=False, grad=False)

    @property
    def qkv_weight(self) -> torch.Tensor:
        """The fused weight [3H, H]: not a parameter, its rows are query/key/value.weight."""
        return self._packed(self.parts())[0]

    @property
    def qkv_bias(self) -> torch.Tensor:
        return self._packed(self.parts())[1]

    def untie(self) -> None:
        """Give query/key/value storage of their own again (what an HF model handed back holds)."""
        for part in self.parts():
            if part is not None:
                part.data = part.data.clone()
        self._fused = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(), .half(), to_empty(), ...: the parts each got new storage
        self.pack()
        return self


_DATA_PTR = torch.Tensor.data_ptr


def _pointers(parts) -> tuple:
    if parts[-1] is None:  # linears without biases (NomicBERT's)
        return tuple(0 if p is None else p.data_ptr() for p in parts)
    return tuple(map(_DATA_PTR, parts))  # (no generator frame per part)


def _cat(parts) -> torch.Tensor | None:
    """The parts side by side along dim 0; None for linears without a bias."""
    if parts[0] is None:
        return None
    if any(p is None for p in parts):
        raise ValueError("fused linears must all have a bias or all have none")
    return torch.cat(parts)


def _alias(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (a slice of a fused tensor) under a storage object of its own that points at the same memory: what a
    checkpoint writer or tied-weights check sees as an independent tensor. DLPack provides that; where it cannot
    (the meta device, where there is no memory to share), a plain view."""
    try:
        return torch.from_dlpack(rows)
    except (RuntimeError, ValueError, TypeError, BufferError):
        return rows
