"""The server's options: one dataclass, `Options`, whose fields are the app's keyword arguments, the command's flags
(fastbert/cli/serve.py reads its defaults from here: --max-batch-tokens is max_batch_tokens) and each Ray replica's
settings; and the Ray deployment's own default. Imports nothing of the server, so the command's parser and its
--help need neither FastAPI nor Ray."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional


@dataclass(frozen=True)
class Options:
    """The server's options, under TEI's names and defaults where TEI has them."""
    device: Optional[str] = None              # None: cuda when available, else cpu
    dtype: Optional[str] = None               # None: what the folder says
    quantize: Optional[str] = None            # the GEMMs' number format: "bf16", "int8" (None: fp32)
    quality_texts: Optional[str] = None       # a file of texts the format's cost is measured on (None: built-in)
    kernels: Any = "auto"                     # as fastbert.BertModel takes it
    max_batch_tokens: int = 16384             # real tokens per batch (no padding is computed)
    max_concurrent_requests: int = 512        # POSTs in flight; past it, 429 at once
    max_client_batch_size: int = 32           # inputs per request; past it, 413
    auto_truncate: bool = False               # cut inputs past the model's limit when a request does not say
    payload_limit: int = 2_000_000            # request body bytes; past it, 413
    api_key: Optional[str] = field(default=None, repr=False)   # never printed
    served_model_name: Optional[str] = None   # the model's name (default: models.served_name of the folder)
    strict_model_name: bool = False           # /v1: refuse (404) a `model` other than the served name; by default,
                                              # as TEI, any `model` is answered by the one model served
    cuda_graphs: bool = True                  # CUDA graphs over token buckets on a GPU
    tokenization_workers: Optional[int] = None  # threads that tokenize (default: min(4, CPUs))

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_concurrent_requests", "max_client_batch_size", "payload_limit",
                     "tokenization_workers"):
            value = getattr(self, name)
            if value is None and name == "tokenization_workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string (or None: no key)")
        for name in ("cuda_graphs", "auto_truncate", "strict_model_name"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


# A replica's batches stay full while about this many requests of a few texts each are in flight on it (the serving
# benchmark's requests carry ~460 real tokens: 32 of them fill ~14,700 of the 16,384-token budget); fewer starve its
# batching, more only queue. The autoscaler adds replicas when the average per replica passes it.
DEFAULT_TARGET_ONGOING_REQUESTS = 32


def default(name: str):
    """Options' default for field `name` (what the command's flag defaults to)."""
    return next(f.default for f in fields(Options) if f.name == name)
