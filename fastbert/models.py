"""transformers' class names, one per model_type fastbert runs, and fastbert.AutoModel, which picks among them.

Every family runs the same fastbert.BertModel (its family is data: fastbert/families.py); each class here is that
model under the name transformers gives the family's encoder, so that `fastbert.ModernBertModel.from_pretrained`
reads as `transformers.ModernBertModel.from_pretrained` does, and `isinstance(model, fastbert.ModernBertModel)` says
which family a model is. A named class refuses a config of another model_type (fastbert.BertModel and
fastbert.AutoModel take any of them).
"""
from __future__ import annotations

from . import config as configs
from . import families
from .loading import read_config, resolve_folder
from .modeling import BertModel


class _NamedModel(BertModel):
    """BertModel for one model_type (`model_type`), under transformers' class name for it."""

    model_type = "bert"

    def __init__(self, config, *args, **kwargs):
        config = configs.load(config)
        if config.model_type != self.model_type:
            raise ValueError(f"fastbert.{type(self).__name__} runs model_type {self.model_type!r}; this config's is "
                             f"{config.model_type!r} (fastbert.AutoModel picks the class from the config)")
        super().__init__(config, *args, **kwargs)


def _named(model_type: str) -> type:
    name = families.encoder_class(model_type)
    return type(name, (_NamedModel,), {"model_type": model_type, "__module__": __name__,
                                        "__qualname__": name,
                                        "__doc__": f"fastbert.BertModel for model_type {model_type!r}, as "
                                                   f"transformers.{name}."})


# model_type -> its class: fastbert.BertModel itself for "bert", a named BertModel for the others
CLASSES = {t: BertModel if t == "bert" else _named(t) for t in families.MODEL_TYPES}
RobertaModel = CLASSES["roberta"]
XLMRobertaModel = CLASSES["xlm-roberta"]
CamembertModel = CLASSES["camembert"]
ElectraModel = CLASSES["electra"]
DistilBertModel = CLASSES["distilbert"]
MPNetModel = CLASSES["mpnet"]
ModernBertModel = CLASSES["modernbert"]
DebertaV2Model = CLASSES["deberta-v2"]
JinaEmbeddingsV3Model = CLASSES["jina_embeddings_v3"]
NomicBertModel = CLASSES["nomic_bert"]
GteModel = CLASSES["gte"]
EuroBertModel = CLASSES["eurobert"]
Qwen3Model = CLASSES["qwen3"]
Gemma3TextModel = CLASSES["gemma3_text"]


def _class_of(config) -> type:
    return CLASSES[configs.load(config).model_type]


class AutoModel:
    """transformers.AutoModel's entry points: the config's model_type picks the class (RobertaModel for "roberta",
    ...); a model_type fastbert does not run raises NotImplementedError naming it."""

    @staticmethod
    def from_pretrained(name_or_path, **kwargs) -> BertModel:
        config, _ = read_config(resolve_folder(name_or_path))
        return _class_of(config).from_pretrained(name_or_path, **kwargs)

    @staticmethod
    def from_config(config, **kwargs) -> BertModel:
        config = configs.load(config)
        return _class_of(config)(config, **kwargs)

    @staticmethod
    def from_hf(hf_model, **kwargs) -> BertModel:
        config = getattr(getattr(hf_model, "base_model", hf_model), "config", None)
        cls = BertModel if config is None or getattr(config, "model_type", None) not in CLASSES \
            else CLASSES[config.model_type]
        return cls.from_hf(hf_model, **kwargs)
