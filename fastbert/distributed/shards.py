"""The output folder: one Parquet shard per split, named after it, plus two small JSON files.

    _fastbert_job.json     written first: what the job computes (model, pipeline options, the input files with their
                           sizes and modification times) and its plan (every split and its shard name)
    part-FFFFF-SSSSS.parquet   the rows of split S of file F, in file order: columns id (string) and embedding
                           (fixed-size list of float32); its footer holds the job's key and its row count
    _manifest.json         written last, once every shard is there and checked: rows, dimension, the shards

A shard is written under a hidden temporary name and renamed when complete, so a name without the dot is always a
whole shard; a rerun of the same job keeps the shards whose footer says this job and the planned row count, and
writes the rest. Readers that skip names starting with "." or "_" (pyarrow.dataset, Spark, Ray Data) see only the
shards; shard names sort in corpus order.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from ..files import write_atomically

JOB_FILE = "_fastbert_job.json"
MANIFEST = "_manifest.json"
KEY = b"fastbert.job"  # Parquet footer key: the job a shard belongs to
_OURS = re.compile(r"^(part-\d+-\d+\.parquet|\.part-\d+-\d+\.parquet\..*\.tmp|_fastbert_job\.json|_manifest\.json"
                   r"|\._fastbert_job\.json\..*\.tmp|\._manifest\.json\..*\.tmp)$")
_TEMPORARY = re.compile(r"^\.(part-\d+-\d+\.parquet|_fastbert_job\.json|_manifest\.json)\..*\.tmp$")


def shard_name(file: int, part: int, files: int, parts: int) -> str:
    """Zero-padded so that names sort in corpus order (at least 5 digits each)."""
    return f"part-{file:0{max(5, len(str(files - 1)))}d}-{part:0{max(5, len(str(parts - 1)))}d}.parquet"


def job_key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def write_json(path: str, obj) -> None:
    def write(tmp):
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
    write_atomically(path, write)


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_shard(path: str, ids: list[str], vectors, key: str) -> None:
    """ids [n] and vectors [n, dim] float32 as one Parquet file, atomically."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
    table = pa.table({"id": pa.array(ids, type=pa.string()), "embedding": embedding})
    table = table.replace_schema_metadata({KEY: key.encode()})
    write_atomically(path, lambda tmp: pq.write_table(table, tmp))


def shard_is_done(path: str, rows: int, key: str) -> bool:
    """The shard exists, its footer parses, and it holds this job's `rows` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        return False
    try:
        meta = pq.read_metadata(path)  # the footer: the row count and the key-value metadata, in one read
    except (pa.ArrowException, OSError):
        return False
    return meta.num_rows == rows and (meta.metadata or {}).get(KEY) == key.encode()


def remove_temporaries(folder: str) -> int:
    """Hidden temporary files that a killed run left behind (never a complete shard); how many were removed."""
    removed = 0
    for name in os.listdir(folder):
        if _TEMPORARY.match(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def foreign_files(folder: str) -> list[str]:
    """Names in the output folder that no fastbert job writes."""
    return sorted(name for name in os.listdir(folder) if not _OURS.match(name))


def remove_job(folder: str) -> None:
    """Every file a fastbert job wrote in `folder` (shards, temporaries, job file, manifest); nothing else."""
    for name in os.listdir(folder):
        if _OURS.match(name):
            os.unlink(os.path.join(folder, name))


def load_embeddings(folder: str):
    """(ids, embeddings) of a finished output folder: the shards in name order, which is corpus order.
    ids: list[str] [n]; embeddings: np.ndarray [n, dim] float32. Refuses a folder whose job has not finished."""
    import numpy as np
    import pyarrow.parquet as pq

    folder = os.fspath(folder)
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{folder!r} holds no finished job ({MANIFEST} is written when every shard is; "
                                f"rerun the job to finish it)")
    manifest = read_json(manifest_path)
    ids, parts = [], []
    for shard in manifest["shards"]:
        table = pq.read_table(os.path.join(folder, shard["name"]))
        if table.num_rows != shard["rows"]:
            raise ValueError(f"{shard['name']}: {table.num_rows} rows, the manifest says {shard['rows']}")
        ids.extend(table.column("id").to_pylist())
        flat = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        parts.append(flat.reshape(table.num_rows, manifest["dimension"]))
    embeddings = np.concatenate(parts) if parts else np.empty((0, manifest["dimension"]), np.float32)
    return ids, embeddings.astype(np.float32, copy=False)
