"""fastbert.encode_dataset: a corpus too big for one process, embedded by a pool of Ray actors into Parquet shards.

    driver   list the input files, plan the splits (corpus.py), write the job file, skip the shards already done
    Ray Data one block per pending split -> map_batches(ShardEncoder, actor pool) -> one summary row per shard
    actor    loads the SentenceEncoder once; per split: read its rows, encode them in token-budget batches (padding-
             free), write the shard under a temporary name and rename it (shards.py)
    driver   collects the summaries, checks every shard's footer, writes the manifest

Nothing lost, nothing doubled: every row belongs to exactly one split (planning), every split to exactly one shard
name, and a shard appears under its name only when complete (a rename). Ray Data restarts an actor that dies and
retries its tasks (max_restarts / max_task_retries = -1 for actor pools); a retried split rewrites the same name with
the same rows. A rerun of an interrupted job keeps the shards that are there and writes the others.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field

from .. import formats
from ..encode import Pipeline, SentenceEncoder, check_counts, check_pooling, check_truncate_dim, locate, resolve_prompt
from . import cluster, corpus, shards
from .corpus import CorpusError, CorpusFile, Split

DEFAULT_ROWS_PER_SHARD = 10_000
# CPUs (= torch threads) per actor on a CPU cluster: one model per core, which out-ran fewer actors with more threads,
# most when other work competed for the cores (bench/RESULTS.md, the Ray sections); cpus_per_worker trades that for
# fewer copies of the model in memory.
DEFAULT_CPUS_PER_CPU_WORKER = 1
INSTALL_HINT = "pip install 'ray[data]>=2.60' (or, in a fastbert checkout, pip install -e '.[ray]')"
# The loading options that change the vectors: a rerun with different ones is a different job. (device, kernels,
# cuda_graphs, max_tokens_per_batch and batch_size change only the rounding.)
_VECTOR_OPTIONS = ("pooling", "normalize", "max_seq_length", "do_lower_case", "include_prompt", "dtype")
# truncate_dim and quantize change the vectors too, but enter a job's key only when given, so that a job planned
# without them resumes as the same job. quality_texts only says what each worker measures a format's cost on.
_OPTIONS = _VECTOR_OPTIONS + ("truncate_dim", "quantize", "quality_texts", "kernels", "cuda_graphs")


def require_ray():
    """ray and ray.data, or an ImportError that says how to install them."""
    try:
        import pyarrow  # noqa: F401
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"encoding a corpus on Ray needs Ray Data: {INSTALL_HINT} ({e})") from None
    return ray


@dataclass
class EncodedDataset:
    """What encode_dataset did. workers: one entry per actor process that encoded a shard (a restarted actor is a
    new process): host, pid, device, load_s (loading the model), ready_s (from the start of the run to the model
    loaded), shards, rows, busy_s (reading, encoding and writing its shards)."""

    output: str
    rows: int
    dimension: int
    shards: int
    written: int                 # shards written by this run
    skipped: int                 # shards already there (a resumed job)
    seconds: float               # the whole call
    run_seconds: float = 0.0     # the Ray part: from submitting the work to the last shard (0 when nothing was left)
    workers: list = field(default_factory=list)


class ShardEncoder:
    """A Ray Data actor: one model, loaded once; each call encodes the splits it is given into their shards."""

    def __init__(self, model: str, load: dict, encode: dict, job: dict, threads: int | None):
        started = time.time()
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.encoder = SentenceEncoder.from_pretrained(model, **load)
        self.encode_options, self.job = encode, job
        self.files = [CorpusFile(**f) for f in job["files"]]
        self.ready_at = time.time()
        self.load_s = self.ready_at - started
        self.host, self.pid = socket.gethostname(), os.getpid()

    def __call__(self, batch: dict) -> dict:
        out = {k: [] for k in ("name", "rows", "error", "host", "pid", "device", "load_s", "ready_at", "seconds")}
        for i in range(len(batch["name"])):
            started = time.perf_counter()
            split = Split(**{k: int(batch[k][i]) for k in ("file", "part", "first_row", "rows", "offset")})
            name, error = str(batch["name"][i]), ""
            try:
                texts, ids = corpus.read_split(self.job["input"], self.files[split.file], split,
                                               self.job["text_field"], self.job["id_field"])
                vectors = self.encoder.encode(texts, progress=False, **self.encode_options)
                shards.write_shard(os.path.join(self.job["output"], name), ids, vectors, self.job["key"])
            except CorpusError as e:  # a property of the data: retrying cannot help, so it travels as a result
                error = str(e)
            out["name"].append(name)
            out["rows"].append(split.rows)
            out["error"].append(error)
            out["host"].append(self.host)
            out["pid"].append(self.pid)
            out["device"].append(str(self.encoder.device))
            out["load_s"].append(self.load_s)
            out["ready_at"].append(self.ready_at)
            out["seconds"].append(time.perf_counter() - started)
        return out


def encode_dataset(model, input, output, *, text_field: str = "text", id_field: str | None = None,
                   format: str | None = None, rows_per_shard: int = DEFAULT_ROWS_PER_SHARD, overwrite: bool = False,
                   workers: int | None = None, cpus_per_worker: float | None = None,
                   gpus_per_worker: float | None = None, device: str | None = None, address: str | None = None,
                   prompt: str | None = None, prompt_name: str | None = None,
                   max_tokens_per_batch: int | None = None, batch_size: int | None = None, progress: bool = True,
                   **options) -> EncodedDataset:
    """Sentence embeddings of every row of a corpus, written as Parquet shards of (id, embedding) to `output`.

    model: a sentence-transformers or Hugging Face BERT folder (a path every Ray node can read) or a Hub id in every
        node's cache. Each actor loads it once, as fastbert.SentenceEncoder.from_pretrained does.
    input: a .txt / .jsonl / .parquet file or a folder of them (recursive; names starting with "." or "_" skipped),
        on a path every node can read. format: read every file as txt, jsonl or parquet whatever its suffix.
    text_field / id_field: the text (and optional id) field of .jsonl records and column of .parquet files. Without
        an id field a row's id is "<file>:<row number from 1>" (the line number for .txt and .jsonl).
    output: a folder (created if missing): part-*.parquet shards, _fastbert_job.json, and _manifest.json when done.
        A rerun of the same job resumes it; a folder holding another job is refused unless overwrite=True, which
        first removes that job's files (and nothing else).
    rows_per_shard: rows per split, the unit of work and of resume.
    workers, cpus_per_worker, gpus_per_worker, device: the actor pool. device None: cuda when the cluster has GPUs.
        On GPUs: one actor per GPU (gpus_per_worker=1; 0.5 puts two models on each GPU), 1 CPU each. On CPU:
        one actor per CPU, each one torch thread (cpus_per_worker=4: a quarter of the actors, 4 threads each).
    address: the Ray cluster to connect to when this process has not already called ray.init ("auto", "host:6379",
        "ray://host:10001"); None follows ray.init: $RAY_ADDRESS, else a cluster started on this machine with
        `ray start`, else a new local one, which is shut down again at the end.
    prompt, prompt_name, max_tokens_per_batch, batch_size, and options (pooling, normalize, max_seq_length,
        do_lower_case, include_prompt, truncate_dim, dtype, quantize, quality_texts, kernels, cuda_graphs): as
        fastbert.encode (quality_texts, a file, on a path every node can read).
    """
    started = time.time()
    vector_options = _validate(options, rows_per_shard=rows_per_shard, workers=workers,
                               cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker, device=device,
                               prompt=prompt, prompt_name=prompt_name, max_tokens_per_batch=max_tokens_per_batch,
                               batch_size=batch_size)
    plan = _plan(model, input, output, vector_options, prompt=prompt, prompt_name=prompt_name, format=format,
                 text_field=text_field, id_field=id_field, rows_per_shard=rows_per_shard, overwrite=overwrite)
    result = EncodedDataset(output=plan.output, rows=sum(s.rows for s in plan.splits), dimension=0,
                            shards=len(plan.splits), written=0, skipped=len(plan.splits) - len(plan.pending),
                            seconds=0.0)
    if plan.pending:
        job = {"input": plan.root, "output": plan.output, "text_field": text_field, "id_field": id_field,
               "key": plan.key, "files": plan.spec["files"]}
        encode = {"prompt": prompt, "prompt_name": prompt_name, "batch_size": batch_size,
                  **({"max_tokens_per_batch": max_tokens_per_batch} if max_tokens_per_batch else {})}
        _run(result, plan.model, options, encode, job, plan.pending, workers=workers, cpus_per_worker=cpus_per_worker,
             gpus_per_worker=gpus_per_worker, device=device, address=address, progress=progress)
    _finish(result, plan)
    result.seconds = time.time() - started
    return result


@dataclass
class _Plan:
    """The job as the driver planned it: what the actors load, where rows come from and go, and what is left."""

    model: str                   # what each actor loads: an absolute folder or a Hub id
    root: str                    # the input file or folder, absolute
    output: str                  # the output folder, absolute
    files: list                  # CorpusFile per input file
    spec: dict                   # what defines the job (its key); a rerun with the same spec resumes it
    key: str
    splits: list                 # every split of the corpus, in corpus order
    names: list                  # the shard name of each split
    pending: list                # (split, name) of the shards not yet written


# --------------------------------------------------------------------------------------------------------------------
# Before any worker starts
# --------------------------------------------------------------------------------------------------------------------
def _validate(options: dict, *, rows_per_shard, workers, cpus_per_worker, gpus_per_worker, device, prompt,
              prompt_name, max_tokens_per_batch, batch_size) -> dict:
    """The arguments checked before anything is read or written; returns the options that change the vectors, in
    the form the job's key records."""
    require_ray()  # without Ray Data no job can run
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"encode_dataset() got unexpected keyword argument(s) {', '.join(unknown)}; the model "
                        f"options are {', '.join(_OPTIONS)}")
    check_counts(rows_per_shard=rows_per_shard, workers=workers, max_tokens_per_batch=max_tokens_per_batch,
                 batch_size=batch_size)
    for name, value in (("cpus_per_worker", cpus_per_worker), ("gpus_per_worker", gpus_per_worker)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (each actor sees its own GPUs as cuda), got {device!r}")
    if prompt is not None and prompt_name is not None:
        raise ValueError("give either prompt or prompt_name, not both")
    vector_options = {k: options.get(k) for k in _VECTOR_OPTIONS}
    if vector_options["pooling"] is not None:  # "cls", ("cls",) and ["cls"] are one job
        vector_options["pooling"] = list(check_pooling(vector_options["pooling"]))
    if options.get("truncate_dim") is not None:
        vector_options["truncate_dim"] = check_truncate_dim(options["truncate_dim"])
    if options.get("quantize") is not None:
        fmt = formats.format_of(options["quantize"])
        vector_options["quantize"] = "fp32" if fmt is None else fmt.name
    if options.get("quality_texts") is not None:  # every actor opens it, wherever its working folder is
        if not os.path.isfile(options["quality_texts"]):
            raise ValueError(f"quality_texts {options['quality_texts']!r}: no such file")
        options["quality_texts"] = os.path.abspath(options["quality_texts"])
    return vector_options


def _plan(model, input, output, vector_options: dict, *, prompt, prompt_name, format, text_field, id_field,
          rows_per_shard, overwrite) -> _Plan:
    """The model checked, the input listed, the output folder opened (a resume reads its plan, a new job writes
    one) and the shards already done set aside."""
    root = os.path.abspath(os.fspath(input))
    output = os.path.abspath(os.fspath(output))
    model = _check_model(model, prompt, prompt_name)
    files = [corpus.describe(root, rel, kind) for rel, kind in corpus.list_files(root, format)]
    if os.path.isdir(root) and (output == root or output.startswith(root + os.sep)):
        raise ValueError(f"the output folder {output!r} is inside the input folder {root!r}: a rerun would read "
                         f"the shards as input")
    spec = {"model": model, "options": vector_options, "prompt": prompt,
            "prompt_name": prompt_name, "input": root, "format": format, "text_field": text_field,
            "id_field": id_field, "rows_per_shard": rows_per_shard, "files": [asdict(f) for f in files]}
    key = shards.job_key(spec)

    splits = _open_output(output, spec, key, overwrite, root, files)
    names = _names(splits, len(files))
    shards.remove_temporaries(output)
    pending = [(s, n) for s, n in zip(splits, names) if not shards.shard_is_done(os.path.join(output, n), s.rows, key)]
    return _Plan(model, root, output, files, spec, key, splits, names, pending)


def _check_model(model, prompt: str | None, prompt_name: str | None) -> str:
    """The model's folder read on the driver (its sentence-transformers files parsed, config.json present, the
    prompt resolved), so that a wrong path, an unsupported module or an unknown prompt name fails here, once,
    rather than in every actor after its model loads. Returns what the actors load: an absolute path for a local
    folder, else the Hub id."""
    from ..loading import resolve_folder

    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a folder or a Hub id (each actor loads it), got {type(model).__name__}")
    path = os.fspath(model)
    model_folder, st, _, _ = locate(path)
    resolve_folder(model_folder, weights=False)
    resolve_prompt(st[0] if st is not None else Pipeline(), prompt, prompt_name)
    return os.path.abspath(path) if os.path.isdir(path) else path


def _open_output(output: str, spec: dict, key: str, overwrite: bool, root: str,
                 files: list[CorpusFile]) -> list[Split]:
    """The plan: the job file's when `output` holds this same job (a resume), else a new one, written there."""
    job_path = os.path.join(output, shards.JOB_FILE)
    if os.path.isdir(output):
        foreign = shards.foreign_files(output)
        if foreign:
            raise ValueError(f"the output folder {output!r} holds files fastbert did not write "
                             f"({', '.join(foreign[:5])}); give a new or empty folder")
        if os.path.isfile(job_path):
            previous = shards.read_json(job_path)
            if previous.get("key") == key:
                return [Split(*s) for s in previous["splits"]]
            if not overwrite:
                raise ValueError(f"the output folder {output!r} holds another job: "
                                 f"{_difference(previous['spec'], spec)}; give a new folder, or overwrite=True "
                                 f"(--overwrite) to replace it")
        else:
            leftover = [n for n in os.listdir(output) if not n.startswith(".")]
            if leftover and not overwrite:
                raise ValueError(f"the output folder {output!r} holds shards without a job file ({leftover[0]}, ...);"
                                 f" give a new folder, or overwrite=True (--overwrite)")
    elif not os.path.isdir(os.path.dirname(output)):
        raise FileNotFoundError(f"the output folder's parent {os.path.dirname(output)!r} does not exist")
    splits = corpus.plan(root, files, spec["rows_per_shard"], spec["text_field"], spec["id_field"])
    if not splits:
        raise CorpusError(f"{root!r}: the corpus has no rows (an empty corpus)")
    os.makedirs(output, exist_ok=True)
    if overwrite:
        shards.remove_job(output)
    shards.write_json(job_path, {"key": key, "spec": spec, "splits": [list(asdict(s).values()) for s in splits]})
    return splits


def _difference(old: dict, new: dict) -> str:
    """What differs between two job specs, in words."""
    if old.get("files") != new.get("files"):
        before = {f["path"]: f for f in old.get("files", [])}
        after = {f["path"]: f for f in new.get("files", [])}
        changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
        return f"the input files differ ({', '.join(changed[:5])}: added, removed, or changed size or time)"
    flat_old, flat_new = ({**{k: v for k, v in spec.items() if k != "options"}, **(spec.get("options") or {})}
                          for spec in (old, new))
    fields = sorted(k for k in set(flat_old) | set(flat_new) if flat_old.get(k) != flat_new.get(k))
    return "its " + ", ".join(f"{k} was {flat_old.get(k)!r}, now {flat_new.get(k)!r}" for k in fields)


def _names(splits: list[Split], files: int) -> list[str]:
    parts = max(s.part for s in splits) + 1
    return [shards.shard_name(s.file, s.part, files, parts) for s in splits]


# --------------------------------------------------------------------------------------------------------------------
# After the workers
# --------------------------------------------------------------------------------------------------------------------
def _finish(result: EncodedDataset, plan: _Plan) -> None:
    """Every shard checked complete, then the manifest written: a job is claimed done only when it is."""
    output, key = plan.output, plan.key
    shards.remove_temporaries(output)
    missing = [n for s, n in zip(plan.splits, plan.names)
               if not shards.shard_is_done(os.path.join(output, n), s.rows, key)]
    if missing:  # cannot happen unless something else writes into the folder: never claim a complete job then
        raise RuntimeError(f"{len(missing)} shard(s) missing or incomplete after the run ({', '.join(missing[:3])}"
                           f"...); rerun to write them")
    import pyarrow.parquet as pq
    result.dimension = pq.read_schema(os.path.join(output, plan.names[0])).field("embedding").type.list_size
    shards.write_json(os.path.join(output, shards.MANIFEST), {
        "job": key, "rows": result.rows, "dimension": result.dimension, "model": plan.model,
        "shards": [{"name": n, "file": plan.files[s.file].path, "first_row": s.first_row, "rows": s.rows}
                   for s, n in zip(plan.splits, plan.names)]})


# --------------------------------------------------------------------------------------------------------------------
# The Ray part
# --------------------------------------------------------------------------------------------------------------------
def _run(result: EncodedDataset, model: str, options: dict, encode: dict, job: dict, pending, *, workers,
         cpus_per_worker, gpus_per_worker, device, address, progress) -> None:
    ray = require_ray()
    if ray.is_initialized() and address is not None:
        raise ValueError(f"address={address!r}: this process is already connected to a Ray cluster (ray.init was "
                         f"called); leave address out to use it")
    with cluster.connected(address) as resources:
        pool = _size_pool(resources, len(pending), workers, cpus_per_worker, gpus_per_worker, device)
        load = {k: v for k, v in options.items() if v is not None}
        load["device"] = pool["device"]
        context = ray.data.DataContext.get_current()
        saved = context.enable_progress_bars
        context.enable_progress_bars = progress
        try:
            dataset = ray.data.from_items(
                [{"name": name, **asdict(split)} for split, name in pending], override_num_blocks=len(pending))
            dataset = dataset.map_batches(
                ShardEncoder, batch_size=1, batch_format="numpy",
                fn_constructor_kwargs={"model": model, "load": load, "encode": encode, "job": job,
                                       "threads": pool["threads"]},
                compute=ray.data.ActorPoolStrategy(size=pool["workers"], max_tasks_in_flight_per_actor=1),
                num_cpus=pool["cpus"], **({"num_gpus": pool["gpus"]} if pool["gpus"] else {}))
            run_started = time.time()
            workers_seen: dict = {}
            for row in dataset.iter_rows():
                if row["error"]:
                    raise CorpusError(f"{row['error']} (shard {row['name']} not written; the {result.written} "
                                      f"shard(s) written so far are kept)")
                result.written += 1
                worker = workers_seen.setdefault((row["host"], int(row["pid"])), {
                    "host": row["host"], "pid": int(row["pid"]), "device": row["device"],
                    "load_s": float(row["load_s"]), "ready_s": float(row["ready_at"]) - run_started,
                    "shards": 0, "rows": 0, "busy_s": 0.0})
                worker["shards"] += 1
                worker["rows"] += int(row["rows"])
                worker["busy_s"] += float(row["seconds"])
            result.run_seconds = time.time() - run_started
            result.workers = sorted(workers_seen.values(), key=lambda w: w["ready_s"])
        finally:
            context.enable_progress_bars = saved


def _size_pool(resources: dict, pending: int, workers, cpus_per_worker, gpus_per_worker, device) -> dict:
    """The actor pool for a cluster's resources: on GPUs one actor per GPU (or per gpus_per_worker), on CPU as many
    actors of cpus_per_worker threads as the CPUs hold; never more actors than pending shards."""
    cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    if device is None:
        device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda":
        if gpus == 0:
            raise ValueError("device='cuda': the Ray cluster has no GPU (ray.cluster_resources() lists none)")
        per_gpu = gpus_per_worker or 1
        per_cpu = cpus_per_worker or 1
        count = workers or max(1, int(gpus // per_gpu))
        threads = None
    else:
        if gpus_per_worker:
            raise ValueError("gpus_per_worker is for device='cuda'")
        per_gpu = 0
        per_cpu = cpus_per_worker or min(DEFAULT_CPUS_PER_CPU_WORKER, max(1, int(cpus)))
        count = workers or max(1, int(cpus // per_cpu))
        threads = max(1, int(per_cpu))
    return {"device": device, "workers": min(count, pending), "cpus": per_cpu, "gpus": per_gpu, "threads": threads}
