"""fastbert: a drop-in Hugging Face BertModel whose four fused ops run as Triton kernels or as PyTorch twins."""
__version__ = "0.1.0"

from .config import BertConfig  # noqa: E402
from .encode import SentenceEncoder, encode  # noqa: E402
from .export import export_onnx  # noqa: E402
from .modeling import BertModel  # noqa: E402
from .ops import BACKENDS, OPS  # noqa: E402

__all__ = ["BertConfig", "BertModel", "OPS", "BACKENDS", "SentenceEncoder", "encode", "export_onnx"]
