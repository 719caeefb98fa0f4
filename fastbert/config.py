"""BertConfig: the fields of a Hugging Face BERT config that the model reads, and nothing it would silently ignore."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from .ops import ACTIVATIONS

MODEL_TYPES = ("bert",)  # the `model_type`s fastbert implements; any other is refused, never loaded as BERT

# Field -> (what it must be, the check). Checked at construction, so a bad config.json fails at load time naming the
# file and the field, not later inside torch.
_INT, _FLOAT = "an integer", "a number"
_FIELD_RULES = {
    "vocab_size": (_INT, 1), "hidden_size": (_INT, 1), "num_hidden_layers": (_INT, 0),
    "num_attention_heads": (_INT, 1), "intermediate_size": (_INT, 1), "max_position_embeddings": (_INT, 1),
    "type_vocab_size": (_INT, 1), "pad_token_id": (_INT, 0),
    "hidden_dropout_prob": (_FLOAT, (0.0, 1.0)), "attention_probs_dropout_prob": (_FLOAT, (0.0, 1.0)),
    "layer_norm_eps": (_FLOAT, (0.0, None)), "initializer_range": (_FLOAT, (0.0, None)),
    "hidden_act": ("a string", None), "position_embedding_type": ("a string", None),
    "is_decoder": ("true or false", None), "add_cross_attention": ("true or false", None),
}
_OPTIONAL = {"pad_token_id"}  # may be null


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
    source: str | None = field(default=None, repr=False, compare=False)  # the config.json it came from, for errors

    def __post_init__(self):
        where = f"config {self.source}" if self.source else "config"
        for name, (kind, bound) in _FIELD_RULES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if kind == _INT:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= bound
                wanted = f"an integer >= {bound}"
            elif kind == _FLOAT:
                low, high = bound
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
                      and (high is None or value <= high))
                wanted = f"a number in [{low}, {high}]" if high is not None else f"a number >= {low}"
            elif kind == "a string":
                ok, wanted = isinstance(value, str), kind
            else:
                ok, wanted = isinstance(value, bool), kind
            if not ok:
                raise ValueError(f"{where}: field {name!r} must be {wanted}, got {value!r} ({type(value).__name__})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None) -> "BertConfig":
        """From config.json's contents. `source` (the file) is named in every error."""
        where = f"config {source}" if source else "config"
        if not isinstance(d, dict):
            raise ValueError(f"{where} must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "bert")  # configs written by hand often omit it
        if model_type not in MODEL_TYPES:
            raise NotImplementedError(f"{where}: model_type={model_type!r} is not implemented by fastbert (it "
                                      f"implements {', '.join(MODEL_TYPES)}); loading it as BERT would give wrong "
                                      f"numbers")
        known = {f.name for f in fields(cls)} - {"extra", "source"}
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known}
        if kwargs.get("position_embedding_type") is None:  # older configs omit it; HF then means "absolute"
            kwargs["position_embedding_type"] = "absolute"
        return cls(**kwargs, extra=extra, source=source)

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
            with open(path, encoding="utf-8") as f:
                try:
                    contents = json.load(f)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"config {path} is not valid JSON: {e}") from None
            return cls.from_dict(contents, source=path)
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
        d.update({k: v for k, v in asdict(self).items() if k not in ("extra", "source")})
        d["model_type"] = "bert"
        d.setdefault("architectures", ["BertModel"])
        return d
