"""BertConfig: the fields of a Hugging Face BERT config that the model reads, and nothing it would silently ignore."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from .ops import ACTIVATIONS


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768                  # H
    num_hidden_layers: int = 12
    num_attention_heads: int = 12           # nh; head_dim = H / nh
    intermediate_size: int = 3072           # I, the FFN width
    hidden_act: str = "gelu"                # "gelu" (erf), "gelu_new", "gelu_pytorch_tanh" or "relu"
    hidden_dropout_prob: float = 0.1        # after each output dense and after the embeddings' LayerNorm (train mode)
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512      # the longest sequence the position table covers
    type_vocab_size: int = 2                # segments (token_type_ids)
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02
    position_embedding_type: str = "absolute"   # the only kind supported
    is_decoder: bool = False                    # unsupported when True
    add_cross_attention: bool = False           # unsupported when True
    extra: dict = field(default_factory=dict, repr=False)  # the checkpoint's other fields, kept for save_pretrained

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "BertConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known}
        if kwargs.get("position_embedding_type") is None:  # older configs omit it; HF then means "absolute"
            kwargs["position_embedding_type"] = "absolute"
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_any(cls, config) -> "BertConfig":
        """From a fastbert.BertConfig, a transformers config, a dict, or a path to config.json / its folder."""
        if isinstance(config, BertConfig):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                return cls.from_dict(json.load(f))
        if hasattr(config, "to_dict"):  # transformers.PretrainedConfig
            return cls.from_dict(config.to_dict())
        raise TypeError(f"cannot build a BertConfig from {type(config).__name__}; "
                        f"give a transformers config, a dict, or a config.json path")

    @classmethod
    def from_pretrained(cls, name_or_path: str) -> "BertConfig":
        from .loading import resolve_folder
        return cls.from_any(os.path.join(resolve_folder(name_or_path, weights=False), "config.json"))

    def check_supported(self) -> None:
        """Raise for any config the model cannot run faithfully (rather than silently running something else)."""
        if self.position_embedding_type != "absolute":
            raise NotImplementedError(f"position_embedding_type={self.position_embedding_type!r} is not supported "
                                      f"(only 'absolute')")
        if self.is_decoder:
            raise NotImplementedError("is_decoder=True is not supported: fastbert is an encoder (bidirectional attention)")
        if self.add_cross_attention:
            raise NotImplementedError("add_cross_attention=True is not supported: fastbert has no cross-attention")
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"hidden_act={self.hidden_act!r} is not supported; "
                                      f"supported: {', '.join(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")

    def to_dict(self) -> dict:
        """The HF config.json contents (transformers' BertModel.from_pretrained reads it)."""
        d = dict(self.extra)
        d.update({k: v for k, v in asdict(self).items() if k != "extra"})
        d["model_type"] = "bert"
        d.setdefault("architectures", ["BertModel"])
        return d
