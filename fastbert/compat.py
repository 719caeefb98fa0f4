"""What callers of a transformers model reach for besides forward: loading and saving, `device` / `dtype`, the
input embeddings and their resizing, gradient checkpointing, the questions pipelines ask. A mixin, so that
fastbert/modeling.py reads as the math; BertModel is its only user.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from . import families

if TYPE_CHECKING:
    from .modeling import BertModel


class TransformersModelMixin:
    """transformers' PreTrainedModel surface for a fastbert encoder (which has `config`, `embeddings`, `layers`)."""

    # PreTrainedModel's loading hints, read off a model by transformers' tests and tools: empty for every encoder
    # fastbert runs, as a transformers model instance holds them (its __init__ turns the classes' None into a set;
    # fastbert's own loader reads the classes' declarations)
    _keys_to_ignore_on_load_missing = frozenset()
    _keep_in_fp32_modules = frozenset()
    _keep_in_fp32_modules_strict = frozenset()

    @property
    def tp_plan(self) -> dict:
        """transformers' tensor-parallel plan: empty. fastbert reads q/k/v (and a gated MLP's gate/up) as one fused
        tensor, which a plan that shards each part's parameter on its own would break, so it declares none even
        where the config names one (EuroBERT's)."""
        return {}

    # ---- loading and saving (fastbert/loading.py does the work) -------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path, *, dtype=None, device=None, kernels="auto", add_pooling_layer=None,
                        torch_dtype=None, padding_free=True, attn_implementation=None, quantize=None,
                        quality_texts=None) -> "BertModel":
        """A local folder (config.json + model.safetensors / pytorch_model.bin) or a Hub id from the local cache, of
        any model_type in fastbert.MODEL_TYPES. add_pooling_layer=None: a pooler when the checkpoint has one.
        attn_implementation= is taken as transformers takes it, and ignored (with a warning). quantize: "bf16" or
        "int8" runs the GEMMs in that format (set_format), measured against fp32 at load on quality_texts (None: the
        built-in sample; `format_quality`)."""
        from .loading import from_pretrained
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; give one of them")
        if attn_implementation is not None:
            # code written for transformers passes it; fastbert's attention is one of its four ops (kernels= picks)
            warnings.warn(f"fastbert: attn_implementation={attn_implementation!r} is ignored: fastbert runs its own "
                          f"attention (the fused kernel or its PyTorch twin, chosen by kernels=)", stacklevel=2)
        return from_pretrained(cls, name_or_path, dtype=dtype if dtype is not None else torch_dtype,
                               device=device, kernels=kernels, add_pooling_layer=add_pooling_layer,
                               padding_free=padding_free, quantize=quantize, quality_texts=quality_texts)

    @classmethod
    def from_hf(cls, hf_model, kernels="auto", padding_free=True) -> "BertModel":
        """From an in-memory transformers encoder (BertModel, RobertaModel, ..., or a head holding one). One copy of
        the weights: every module but the fused QKV is HF's own object, and HF's query/key/value become views of the
        fused weight, so training either model trains both."""
        from .loading import from_hf
        return from_hf(cls, hf_model, kernels=kernels, padding_free=padding_free)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """config.json + model.safetensors (safe_serialization=False: pytorch_model.bin) that transformers loads."""
        from .loading import save_pretrained
        save_pretrained(self, save_directory, **kwargs)

    # ---- where callers of a transformers model touch it ---------------------------------------------------------
    @property
    def base_model_prefix(self) -> str:
        """The attribute a head keeps this encoder under ("bert", "roberta", "electra", "distilbert", "mpnet"), as
        transformers names it."""
        return self.family.prefix.rstrip(".")

    @property
    def base_model(self) -> "BertModel":  # transformers' answer for a bare encoder: itself
        return self

    def init_weights(self) -> None:
        """transformers' initialisation, again: what a model built on meta and moved with to_empty() needs."""
        self.apply(self._init_weights)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        embeddings = {f"{name}.weight" for name, m in self.named_modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for name, p in self.named_parameters()
                   if (p.requires_grad or not only_trainable) and not (exclude_embeddings and name in embeddings))

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word_embeddings.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        setattr(self.embeddings, self.embeddings.word_embeddings_name, value)

    def get_output_embeddings(self) -> None:  # an encoder has no LM head (transformers' BertModel answers None too)
        return None

    def enable_input_require_grads(self) -> None:
        """The input embeddings' output requires grad: with frozen weights (PEFT) and gradient checkpointing, the
        gradient still reaches the adapters of the first layers."""
        self.disable_input_require_grads()
        hook = self.get_input_embeddings().register_forward_hook(lambda module, args, out: out.requires_grad_(True))
        self.__dict__["_require_grads_hooks"] = [hook]

    def disable_input_require_grads(self) -> None:
        for hook in self.__dict__.pop("_require_grads_hooks", []):
            hook.remove()

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """transformers' resize: the first rows kept, new rows the mean of the old ones (mean_resizing, the centre of
        the distribution transformers samples them from) or drawn like a fresh model's; config.vocab_size follows."""
        if pad_to_multiple_of is not None and not isinstance(pad_to_multiple_of, int):  # transformers' own words
            raise ValueError(f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which is "
                             f"not and integer. Please make sure to pass an integer")
        sizes = (("new_num_tokens", new_num_tokens, None), ("pad_to_multiple_of", pad_to_multiple_of, 1))
        for name, value, least in sizes:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or (least is not None and value < least)):
                wanted = "a positive integer" if least else "an integer"
                raise ValueError(f"resize_token_embeddings: {name} must be {wanted} or None, got {value!r}")
        old = self.get_input_embeddings()
        n = old.num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
        if n == old.num_embeddings:
            return old
        if self.task_names:
            raise NotImplementedError(f"resize_token_embeddings({n}): the word table's task adapters hold a row per "
                                      f"token (lora_A [tasks, {old.num_embeddings}, rank]); resizing them is not "
                                      f"implemented")
        new = nn.Embedding(n, old.embedding_dim, padding_idx=old.padding_idx if (old.padding_idx or 0) < n else None,
                           device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            keep = min(n, old.num_embeddings)
            new.weight[:keep] = old.weight[:keep]
            if n > keep:
                if mean_resizing:
                    new.weight[keep:] = old.weight.mean(dim=0)
                else:
                    new.weight[keep:].normal_(std=self.config.initializer_range)
        new.weight.requires_grad_(old.weight.requires_grad)
        self.set_input_embeddings(new)
        self.config.vocab_size = self.vocab_size = n  # (transformers sets both)
        return new

    def get_position_embeddings(self) -> nn.Embedding:
        self._check_resizable_positions("get_position_embeddings")
        return self.embeddings.position_embeddings

    def resize_position_embeddings(self, new_num_position_embeddings: int) -> None:
        """transformers' DistilBertModel.resize_position_embeddings: the first rows kept, config.max_position_embeddings
        follows. New rows are drawn as a fresh model's (std initializer_range; transformers draws N(0, 1)); a
        sinusoidal table (sinusoidal_pos_embds) is computed again at the new size, frozen as transformers freezes it."""
        self._check_resizable_positions("resize_position_embeddings")
        n = new_num_position_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"resize_position_embeddings: new_num_position_embeddings must be a positive integer, "
                             f"got {n!r}")
        old = self.embeddings.position_embeddings
        if n == old.num_embeddings:
            return
        new = nn.Embedding(n, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            if getattr(self.config, "sinusoidal_pos_embds", False):
                from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings
                create_sinusoidal_embeddings(n, old.embedding_dim, new.weight)
            else:
                keep = min(n, old.num_embeddings)
                new.weight[:keep] = old.weight[:keep]
                new.weight[keep:].normal_(std=self.config.initializer_range)
                new.weight.requires_grad_(old.weight.requires_grad)
        self.embeddings.position_embeddings = new
        self.config.max_position_embeddings = n

    def _check_resizable_positions(self, method: str) -> None:
        if not self.family.resizable_positions:  # transformers' PreTrainedModel refuses it for these families too
            raise NotImplementedError(f"{method}: transformers' {families.encoder_class(self.config.model_type)} has "
                                      f"no {method}, so fastbert's {self.family.title} encoder has none either")

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each layer in the backward pass instead of keeping its activations (train mode, torch path)."""
        import functools

        from torch.utils.checkpoint import checkpoint
        kwargs = {"use_reentrant": True} if gradient_checkpointing_kwargs is None else gradient_checkpointing_kwargs
        for layer in self.layers:
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        for layer in self.layers:
            layer.gradient_checkpointing = False

    activation_checkpointing_enable = gradient_checkpointing_enable  # transformers 5's newer names
    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(layer.gradient_checkpointing for layer in self.layers)

    is_activation_checkpointing = is_gradient_checkpointing  # transformers 5's newer name

    def can_generate(self) -> bool:  # transformers' pipelines ask
        return False
