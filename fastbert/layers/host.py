"""The host-cost shortcuts the model's forwards take where nothing could tell them from the module calls they skip.

At small batches a forward's cost is Python work on the host: nn.Module.__call__ and its attribute lookups cost
10-20 k instructions a module (bench/RESULTS.md, the host-bound cell), more than the op itself. Each shortcut here
calls the same torch function the module's forward would, on the module's own parameters, and only where the module
is exactly the stock class with no hook, no replaced or compiled forward: anything a caller could have changed is
honoured by calling the module.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _torch_module

try:  # transformers finds the layers it may checkpoint by this class (gradient_checkpointing_enable, PEFT, Trainer)
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers before 4.52: the same behaviour, under the same name

    class GradientCheckpointingLayer(nn.Module):
        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)


def plain(module: nn.Module | None, cls: type) -> bool:
    """`module` is exactly a `cls` whose forward nothing could tell from the op the caller runs on its tensors instead:
    no hook of its own or on every module, its forward neither replaced nor compiled on the instance."""
    return type(module) is cls and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or module._compiled_call_impl is not None or "forward" in module.__dict__
        or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks)


def embed(table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """table(ids): nn.Embedding's forward (F.embedding without max_norm) on its weight where nothing can tell."""
    if plain(table, nn.Embedding) and table.max_norm is None:
        pad = table.padding_idx
        return torch.embedding(table._parameters["weight"], ids, -1 if pad is None else pad,
                               table.scale_grad_by_freq, table.sparse)
    return table(ids)


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x): nn.LayerNorm's forward on its parameters where nothing can tell."""
    if plain(module, nn.LayerNorm):
        p = module._parameters
        return torch.layer_norm(x, module.normalized_shape, p["weight"], p["bias"], module.eps)
    return module(x)


def drop(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """dropout(x): nn.Dropout's forward where nothing can tell (in eval mode, x itself)."""
    if plain(dropout, nn.Dropout):
        return F.dropout(x, dropout.p, True, dropout.inplace) if dropout.training else x
    return dropout(x)


def linear(dense: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """dense(x): nn.Linear's forward on its parameters where nothing can tell."""
    if plain(dense, nn.Linear):
        p = dense._parameters
        return F.linear(x, p["weight"], p["bias"])
    return dense(x)


def _module_call(layer, *args):
    return layer(*args)  # the layer's own __call__ (before transformers 4.52, checkpointing lives there)


def layer_call(layers, run, cls: type):
    """How the encoder calls its layers (all of class `cls`) this forward. Where nothing can tell the difference, the
    class's forward itself: nn.Module.__call__ and the checkpointing wrapper cost ~17 k instructions of host work a
    layer (bench/RESULTS.md, the host-bound cell). Through the module otherwise: a hook on a layer or a global one, a
    compiled, replaced or checkpointing layer, a trace (it records module scopes)."""
    if run.traced:
        return _module_call
    for layer in layers:
        if not plain(layer, cls) or layer.gradient_checkpointing:
            return _module_call
    return getattr(cls.forward, "__wrapped__", cls.forward)  # under the wrapper GradientCheckpointingLayer puts on it
