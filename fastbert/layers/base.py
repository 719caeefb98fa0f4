"""What every layer shape shares: its modules at HF's paths, its dropouts' p as transformers reads them, and the
module at a role now (PEFT and from_hf put theirs there).

A family's `layer` dict names each role's HF module path (query, key, value, attn_out, ln1, ffn_in, ffn_out, ln2;
or qkv where the checkpoint fuses q/k/v). The shape builds the leaves (`leaves`); the containers on the way are
fastbert's own: FusedQKV where query/key/value sit, an empty Block elsewhere. So HF's checkpoints, names, optimizer
states (saved by position: the family's order is HF's) and adapters fit a layer as they are.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import families, twins
from ..units.residual_layernorm import rms_norm  # HF's RMSNorm forward, defined once: the op's twin runs it too
from .fused_qkv import FusedQKV
from .host import GradientCheckpointingLayer

NO_DROPOUT = (0.0, 0.0, 0.0, 0.0, 0.0)

# Roles whose linears read the same input and run as one GEMM over a fused weight (FusedQKV): query/key/value where a
# checkpoint keeps them apart; a gated MLP's gate (activated) and up projections where it keeps them apart.
FUSED_GROUPS = (("query", "key", "value"), ("ffn_gate", "ffn_up"))


class RMSNorm(nn.Module):
    """transformers' RMSNorm of the Llama-shaped encoders (EuroBERT): x / sqrt(mean(x^2) + eps) in float32, back in
    x's dtype, times weight; HF's parameter and attribute names (`weight`, `variance_epsilon`)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    @staticmethod
    def is_plain(module: nn.Module) -> bool:
        """`module` computes this class's forward, so an op may run it from its `weight` and `variance_epsilon`:
        fastbert's RMSNorm, or transformers' own of the same definition (`is_rms_norm`; from_hf puts HF's in the
        norm's place). Anything else in that place (another kind of norm, a subclass) is called as the module it is."""
        cls = type(module)
        return cls is RMSNorm or cls.__module__.startswith("transformers.") and is_rms_norm(module)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) times (1 + weight), all in float32, rounded back to x's dtype once
    (transformers' Gemma3RMSNorm, operation for operation). The weight is stored as the offset from 1, so a fresh one
    is zeros; HF's parameter and attribute names (`weight`, `eps`)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def is_offset_rms_norm(module: nn.Module) -> bool:
    """fastbert's OffsetRMSNorm or transformers' own of that definition (Gemma3RMSNorm): a `weight`, an `eps`."""
    return type(module).__name__.endswith("RMSNorm") and set(module._parameters) == {"weight"} \
        and isinstance(getattr(module, "eps", None), float) and not hasattr(module, "variance_epsilon")


def is_rms_norm(module: nn.Module) -> bool:
    """fastbert's RMSNorm or a transformers one of the same definition (EuroBertRMSNorm, LlamaRMSNorm, ...): a
    `weight` and a `variance_epsilon`, no other parameter."""
    return type(module).__name__.endswith("RMSNorm") and set(module._parameters) == {"weight"} \
        and isinstance(getattr(module, "variance_epsilon", None), float)


class Block(nn.Module):
    """A container at one of HF's module paths inside a layer (attention, attention.output, ffn, ...): it holds
    modules, computes nothing (the layer's forward does, through the four ops)."""


class EncoderLayer(GradientCheckpointingLayer):
    """The modules of one encoder layer at HF's paths for the family. A layer shape (post_norm.py, pre_norm.py,
    disentangled.py) says which leaves it holds and how its forward runs them through the four ops."""

    def __init__(self, config, family: families.Family, index: int = 0):
        super().__init__()
        self.config = config
        self.family = family
        H = config.hidden_size
        paths = {role: tuple(path.split(".")) for role, path in family.layer.items()}
        leaves = self.leaves(config, family, index)
        # the containers whose linears run as one GEMM over a fused weight: q/k/v; a gated MLP's gate and up
        fused = {paths[group[0]][:-1]: group for group in FUSED_GROUPS if group[0] in paths}
        for role in family.layer:  # in HF's order, which is the order of the family's roles
            *parents, leaf = paths[role]
            node = self
            for depth, name in enumerate(parents):
                if name not in node._modules:
                    group = fused.get(tuple(parents[:depth + 1]))
                    node.add_module(name, Block() if group is None else
                                    self.fused_linears(config, group, tuple(paths[r][-1] for r in group)))
                node = node._modules[name]
            if role in leaves:
                node.add_module(leaf, leaves[role])
        self._init_dropouts(config, family)
        # role -> (the container holding its module, the module's name there). The containers are fastbert's own and
        # stay; the module in one is read at every forward, since PEFT and from_hf put theirs there. Not submodules.
        self.__dict__["_slots"] = {role: (self.get_submodule(".".join(paths[role][:-1])), paths[role][-1])
                                   for role in family.layer}
        # read once: a transformers config attribute costs ~1 us, and the weights' shapes fix these anyway (the norms'
        # eps and the dropouts' p are read off their modules at every forward, as transformers' forward reads them)
        self.num_heads = config.num_attention_heads
        self.activation = twins.ACTIVATIONS[family.get(config, "hidden_act")]
        self.scale = twins.default_scale(H // config.num_attention_heads)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable (also a head's, transformers')

    def fused_linears(self, config, roles: tuple, names: tuple) -> FusedQKV:
        """The container of a fused group (FUSED_GROUPS) at HF's module names `names`: q/k/v of width H with biases."""
        return FusedQKV(config.hidden_size, names)

    def leaves(self, config, family: families.Family, index: int) -> dict:
        """role -> the module this shape puts at the role's path (query/key/value: FusedQKV builds them)."""
        raise NotImplementedError

    @staticmethod
    def workspace(x, run) -> twins.Workspace | None:
        """Buffers the shape's twins reuse from layer to layer in a forward of plan `run`, or None (the ops
        allocate)."""
        return None

    def dropout_paths(self, config) -> dict:
        """kind -> (HF's path, config field) of the dropouts this layer holds (the family's)."""
        return self.family.dropouts

    def place_dropout(self, holder: nn.Module, name: str, kind: str, p: float) -> None:
        holder.add_module(name, nn.Dropout(p))

    def _init_dropouts(self, config, family: families.Family) -> None:
        """HF's dropout modules at HF's paths, built as the config says. `_dropouts`: (holder, name) of each of
        families.DROPOUT_KINDS, or None where the layer has none (DistilBERT after its attention output). Not
        submodules."""
        slots = {}
        for kind, (path, field) in self.dropout_paths(config).items():
            parent, _, name = path.rpartition(".")
            holder = self.get_submodule(parent)
            self.place_dropout(holder, name, kind, family.get(config, field))
            slots[kind] = (holder, name)
        self.__dict__["_dropouts"] = tuple(slots.get(kind) for kind in families.DROPOUT_KINDS)

    def module(self, role: str) -> nn.Module:
        """The module at `role`'s HF path now (an adapter PEFT put there, if any), read through its container's
        module dict: each nn.Module.__getattr__ step is Python work on the host (bench/RESULTS.md, "Measurements
        cited by the code")."""
        parent, name = self._slots[role]
        return parent._modules[name]

    @property
    def self_attention(self) -> FusedQKV | None:
        """The module that holds query/key/value and their fused weight (None where the checkpoint fuses them)."""
        slot = self._slots.get("query")
        return None if slot is None else slot[0]

    def gate_up(self, run) -> tuple:
        """(W [2I, H], b or None) of a gated MLP whose gate and up projections the checkpoint keeps apart: the
        FusedQKV over the pair, as this forward (`run`, dispatch.Ops) needs it (FusedQKV.fused)."""
        pair = self._slots["ffn_gate"][0]
        return pair.fused(pair.parts(), run.traced, run.grad)

    def fused_holders(self) -> tuple:
        """The layer's FusedQKV containers (q/k/v; a gated MLP's gate and up), whose weights loading packs and
        restore unties."""
        return tuple(self._slots[group[0]][0] for group in FUSED_GROUPS if group[0] in self._slots)

    def dropouts(self) -> tuple[float, float, float, float, float]:
        """(attention probabilities, attention output, FFN, DeBERTa's positions, a post-norm gated MLP's act(a) * g)
        dropout in train mode (the forward takes none in eval mode): the p of the layer's dropout modules now, where
        transformers' forward reads it (so a change after the model was built is seen by the next forward)."""
        return tuple(0.0 if slot is None else _probability(*slot) for slot in self._dropouts)


def _probability(holder: nn.Module, name: str) -> float:
    """The dropout probability transformers' forward applies at holder.<name> now: the p of the module there while
    it is in train mode (0 for nn.Identity); where the name is a float (ModernBERT's attention_dropout), that float
    while the holder is in train mode."""
    module = holder._modules.get(name)
    if module is not None:
        return getattr(module, "p", 0.0) if module.training else 0.0
    return getattr(holder, name, 0.0) if holder.training else 0.0
