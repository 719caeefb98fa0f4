"""fastbert: a drop-in Hugging Face BertModel whose four fused ops run as Triton kernels or as PyTorch twins."""
from .config import MODEL_TYPES
from .modeling import AutoModel, BertModel
from .ops import BACKENDS, OPS
from .patch import optimize, restore

__all__ = ["AutoModel", "BertModel", "MODEL_TYPES", "OPS", "BACKENDS", "optimize", "restore"]
