"""Adapters (PEFT LoRA) on fastbert's linear layers, without importing peft.

PEFT wraps a target nn.Linear in a module that keeps the original as `base_layer` and adds a low-rank path:
y = base_layer(x) + scaling * B(A(dropout(x))). fastbert keeps query/key/value's base layers in its one fused QKV
GEMM and adds each wrapped part's low-rank path to that GEMM's output (`lora_delta`); every other wrapped linear is
called as the module it is.
"""
from __future__ import annotations

import torch
import torch.nn as nn


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
