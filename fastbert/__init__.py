"""fastbert: a drop-in Hugging Face BertModel whose four fused ops run as Triton kernels or as PyTorch twins."""
from .config import BertConfig
from .encode import SentenceEncoder, encode
from .modeling import BertModel
from .ops import BACKENDS, OPS

__all__ = ["BertConfig", "BertModel", "OPS", "BACKENDS", "SentenceEncoder", "encode"]
