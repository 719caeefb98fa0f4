"""Corpus encoding on a Ray cluster (an optional extra: pip install -e '.[ray]' in a checkout, or
pip install 'ray[data]'). Importing this package imports neither ray nor pyarrow; encode_dataset does, when called."""
from .corpus import CorpusError
from .job import DEFAULT_ROWS_PER_SHARD, EncodedDataset, encode_dataset, require_ray
from .shards import load_embeddings

__all__ = ["CorpusError", "DEFAULT_ROWS_PER_SHARD", "EncodedDataset", "encode_dataset", "load_embeddings",
           "require_ray"]
