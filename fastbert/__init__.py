"""fastbert: a drop-in Hugging Face BertModel whose four fused ops run as Triton kernels or as PyTorch twins."""
from .config import MODEL_TYPES  # noqa: E402
from .dispatch import BACKENDS, OPS, batch_invariant  # noqa: E402
from .distributed import encode_dataset, load_embeddings  # noqa: E402  (imports ray only when called)
from .encode import SentenceEncoder, encode  # noqa: E402
from .export import export_onnx  # noqa: E402
from .modeling import BertModel  # noqa: E402
from .models import (  # noqa: E402
    AutoModel,
    CamembertModel,
    DebertaV2Model,
    DistilBertModel,
    ElectraModel,
    EuroBertModel,
    Gemma3TextModel,
    GteModel,
    JinaEmbeddingsV3Model,
    ModernBertModel,
    MPNetModel,
    NomicBertModel,
    Qwen3Model,
    RobertaModel,
    XLMRobertaModel,
)
from .patch import optimize, restore  # noqa: E402
from .version import __version__  # noqa: F401

__all__ = ["AutoModel", "BertModel", "RobertaModel", "XLMRobertaModel", "CamembertModel", "ElectraModel",
           "DistilBertModel", "MPNetModel", "ModernBertModel", "DebertaV2Model", "JinaEmbeddingsV3Model",
           "NomicBertModel", "GteModel", "EuroBertModel", "Qwen3Model", "Gemma3TextModel", "MODEL_TYPES", "OPS",
           "BACKENDS",
           "optimize", "restore", "SentenceEncoder", "encode", "encode_dataset", "load_embeddings", "export_onnx",
           "batch_invariant"]
