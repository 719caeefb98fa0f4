"""python -m fastbert encode: sentence embeddings of a corpus, as sentence-transformers computes them
(fastbert/encode.py), written to a .npy file; with --ray, a corpus bigger than one process, on a Ray cluster
(fastbert/distributed)."""
from __future__ import annotations

import argparse
import os
import sys

from .common import (
    DTYPES,
    Parser,
    UsageError,
    add_format_options,
    add_ray_address,
    count,
    default_model,
    device_of,
    fraction,
    parse_kernels,
)


def read_input(path: str) -> bytes:
    """The bytes of --input: a file, or standard input for '-'."""
    if path == "-":
        return sys.stdin.buffer.read()
    if not os.path.isfile(path):
        raise UsageError(f"--input {path!r}: no such file" if not os.path.exists(path) else
                         f"--input {path!r} is not a file")
    with open(path, "rb") as f:
        return f.read()


def split_lines(data: bytes, path: str) -> list[str]:
    """One text per line (a trailing newline ends the last line, it does not add an empty one; a final \\r is
    dropped). A line that is not UTF-8 is named by its number. Each line is decoded as the corpus reader of --ray
    decodes it (fastbert/distributed/corpus.py)."""
    from ..distributed.corpus import CorpusError, decode_line

    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    try:
        return [decode_line(line, f"--input {path!r}", number) for number, line in enumerate(lines, start=1)]
    except CorpusError as e:
        raise UsageError(str(e)) from None


def read_lines(path: str) -> list[str]:
    """A .txt input: one text per line, empty lines included (each is a text, embedded as sentence-transformers
    embeds an empty string)."""
    return split_lines(read_input(path), path)


def read_jsonl(path: str, lines: list[str], text_field: str, id_field: str | None) -> tuple[list[str], list[str]]:
    """A .jsonl input: one JSON object per line, the text under `text_field` (and an id under `id_field`).
    (texts, ids); ids are the input line numbers when no id field is named. Each line is read as the corpus reader
    of --ray reads it (fastbert/distributed/corpus.py, which imports neither ray nor pyarrow)."""
    from ..distributed.corpus import CorpusError, parse_jsonl

    texts, ids = [], []
    for number, line in enumerate(lines, start=1):
        try:
            text, identifier = parse_jsonl(line, f"--input {path!r}", number, text_field, id_field)
        except CorpusError as e:
            raise UsageError(str(e)) from None
        identifier = str(number) if identifier is None else identifier
        if "\n" in identifier or "\r" in identifier:
            raise UsageError(f"--input {path!r}: line {number}: the id {identifier[:40]!r} holds a line break (the "
                             f"ids file has one id a line)")
        texts.append(text)
        ids.append(identifier)
    return texts, ids


def check_output(path: str, option: str = "--output") -> None:
    """--output: a .npy path whose folder exists and is writable. np.save appends .npy to any other name, so the
    suffix is required rather than silently changed. --ids: the same, any suffix."""
    if option == "--output" and not path.endswith(".npy"):
        raise UsageError(f"--output {path!r} must end in .npy (the file is written in NumPy's .npy format)")
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a folder; give a file name" + (" ending in .npy" if option == "--output"
                                                                              else ""))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path!r}: the folder {folder!r} is not writable")


def save_outputs(output: str, embeddings, ids_path: str | None, ids: list[str]) -> None:
    """The .npy (and the ids file), each whole or not at all (fastbert/files.py): a run that fails half way (a full
    disk, a kill) leaves existing files untouched and no partial file behind. The ids are written first and land
    last, once the embeddings have."""
    import numpy as np

    from ..files import write_atomically

    def write_npy(tmp):
        with open(tmp, "xb") as f:  # a file object: given a name without .npy, np.save would append it
            np.save(f, embeddings)

    def write_ids_then_npy(tmp):
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.writelines(line + "\n" for line in ids)
        write_atomically(output, write_npy)

    if ids_path:
        write_atomically(ids_path, write_ids_then_npy)
    else:
        write_atomically(output, write_npy)


def encode(args) -> int:
    import warnings

    from ..encode import SentenceEncoder

    if args.ray is not None:
        return encode_on_ray(args)
    given = [option for option, value in (("--workers", args.workers), ("--cpus-per-worker", args.cpus_per_worker),
                                          ("--gpus-per-worker", args.gpus_per_worker),
                                          ("--rows-per-shard", args.rows_per_shard), ("--overwrite", args.overwrite))
             if value not in (None, False)]
    if given:
        raise UsageError(f"{given[0]} is an option of --ray (a corpus encoded by Ray workers into a folder)")
    if args.format == "parquet":
        raise UsageError("--format parquet: Parquet input is read with --ray (the output is then a folder of shards)")
    # Everything that can be checked is checked before the model loads.
    device = str(device_of(args))
    fmt = args.format or ("jsonl" if args.input.endswith((".jsonl", ".ndjson")) else "txt")
    if fmt == "txt" and args.id_field:
        raise UsageError("--id-field reads .jsonl input (give --format jsonl, or a .jsonl file)")
    if args.id_field and not args.ids:
        raise UsageError("--id-field needs --ids FILE to write the ids to")
    lines = read_lines(args.input)
    if not lines:
        raise UsageError(f"--input {args.input!r} has no lines")
    if fmt == "jsonl":
        texts, ids = read_jsonl(args.input, lines, args.text_field, args.id_field)
    else:
        texts, ids = lines, [str(number) for number in range(1, len(lines) + 1)]
    check_output(args.output)
    if args.ids:
        check_output(args.ids, "--ids")
        if os.path.abspath(args.ids) == os.path.abspath(args.output):
            raise UsageError(f"--ids {args.ids!r} is the --output file")
    if args.prompt is not None and args.prompt_name is not None:
        raise UsageError("give --prompt or --prompt-name, not both")

    def one_line(message, category, *rest, **kwargs):  # a notice (e.g. defaults for a plain folder): one line
        text = " ".join(str(message).split())
        print(f"python -m fastbert encode: note: {text.removeprefix('fastbert: ')}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = one_line
        warnings.filterwarnings("always", message="fastbert:")
        encoder = SentenceEncoder.from_pretrained(
            args.model or default_model(), pooling=args.pooling, normalize=args.normalize,
            max_seq_length=args.max_seq_length, do_lower_case=args.lowercase, include_prompt=args.include_prompt,
            dtype=args.dtype, device=device, kernels=args.kernels or "auto", cuda_graphs=not args.no_cuda_graphs,
            truncate_dim=args.truncate_dim, quantize=args.quantize, quality_texts=args.quality_texts)
        result = encoder.encode(texts, prompt=args.prompt, prompt_name=args.prompt_name,
                                max_tokens_per_batch=args.max_tokens_per_batch, batch_size=args.batch_size,
                                progress=False if args.no_progress else None)
    save_outputs(args.output, result, args.ids, ids)
    source = "its sentence-transformers config" if encoder.pipeline.source == "sentence-transformers" else "defaults"
    print(f"wrote {result.shape[0]} embeddings of size {result.shape[1]} to {args.output}"
          + (f" and their ids to {args.ids}" if args.ids else "")
          + f" ({encoder.pipeline.describe()}: {source})")
    return 0


def encode_on_ray(args) -> int:
    """--ray: the corpus (a file or a folder) embedded by a pool of Ray actors into Parquet shards in --output."""
    from ..distributed import job

    try:
        job.require_ray()
    except ImportError:
        raise UsageError(f"--ray needs Ray Data, which is not installed: {job.INSTALL_HINT}") from None
    if args.input == "-":
        raise UsageError("--ray reads files or a folder (each worker reads its own rows), not standard input")
    if args.ids:
        raise UsageError("--ids: with --ray the ids are the shards' id column")
    if args.output.endswith(".npy"):
        raise UsageError(f"--output {args.output!r}: with --ray the output is a folder of Parquet shards")
    if not os.path.exists(args.input):
        raise UsageError(f"--input {args.input!r}: no such file or folder")
    result = job.encode_dataset(
        args.model or default_model(), args.input, args.output, text_field=args.text_field, id_field=args.id_field,
        format=args.format, rows_per_shard=args.rows_per_shard or job.DEFAULT_ROWS_PER_SHARD,
        overwrite=args.overwrite, workers=args.workers, cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker, device=args.device, address=args.ray or None, prompt=args.prompt,
        prompt_name=args.prompt_name, max_tokens_per_batch=args.max_tokens_per_batch, batch_size=args.batch_size,
        progress=not args.no_progress, pooling=args.pooling, normalize=args.normalize,
        max_seq_length=args.max_seq_length, do_lower_case=args.lowercase, include_prompt=args.include_prompt,
        dtype=args.dtype, kernels=args.kernels, cuda_graphs=False if args.no_cuda_graphs else None,
        truncate_dim=args.truncate_dim, quantize=args.quantize, quality_texts=args.quality_texts)
    done = (f"{result.written} written by {len(result.workers)} worker(s) in {result.seconds:.1f} s"
            + (f", {result.skipped} already there (resumed)" if result.skipped else "")) if result.written else \
        "all already there (nothing left to do)"
    print(f"{result.rows} embeddings of size {result.dimension} in {result.output}: {result.shards} shard(s), {done}")
    return 0


def _pooling(text: str) -> tuple[str, ...]:
    from ..encode import POOLING_MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in POOLING_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: the pooling modes are {', '.join(POOLING_MODES)} "
                                         f"(several, comma-separated, are concatenated)")
    return modes


ENCODE_EPILOG = """\
examples:
  python -m fastbert encode --input corpus.txt --output emb.npy
  python -m fastbert encode --model FOLDER --input docs.jsonl --text-field body --id-field _id --ids ids.txt \\
      --output emb.npy --device cuda --dtype bfloat16 --max-tokens-per-batch 32768
  cat queries.txt | python -m fastbert encode --input - --output q.npy --prompt-name query
  python -m fastbert encode --ray --input corpus/ --text-field body --id-field _id --output shards/
  python -m fastbert encode --ray auto --input /shared/corpus --output /shared/emb --dtype bfloat16

Row i of the .npy is the i-th input text (input order is kept). A sentence-transformers folder's own settings
(modules.json: pooling, Normalize; sentence_bert_config.json: max_seq_length, do_lower_case; prompts) apply unless
an option overrides them. A plain Hugging Face folder gets sentence-transformers' defaults for it (mean pooling, no
Normalize, max_seq_length = the tokenizer's limit) and a one-line note says so. A model with modules fastbert does
not reproduce (Dense, LayerNorm, ...) is refused. With --ray, --output is a folder of Parquet shards (id,
embedding) in corpus order; rerunning the same command resumes an interrupted job. Exit codes: 0 done, 2 a user
error (one line on stderr)."""


def encode_parser() -> Parser:
    from ..encode import CPU_MAX_TOKENS_PER_BATCH, DEFAULT_MAX_TOKENS_PER_BATCH

    parser = Parser(prog="python -m fastbert encode", description="Sentence embeddings of a corpus, as "
                     "sentence-transformers computes them, written to a .npy file.", epilog=ENCODE_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    io = parser.add_argument_group("input and output")
    io.add_argument("--input", metavar="FILE|-", help="the texts: a .txt file (one text a line; empty lines are "
                    "texts too), a .jsonl file (one JSON object a line), or - for standard input (UTF-8)")
    io.add_argument("--output", metavar="FILE.npy", help="the embeddings, float32 [texts, dim], row i for input "
                    "text i; written to a temporary file and renamed, so a failed run leaves no partial file")
    io.add_argument("--format", choices=("txt", "jsonl", "parquet"), help="how to read --input (default: jsonl "
                    "for a .jsonl or .ndjson file, txt otherwise, standard input included; with --ray, by each "
                    "file's suffix, .parquet too)")
    io.add_argument("--text-field", default="text", metavar="NAME",
                    help="jsonl: the field that holds the text (default: text)")
    io.add_argument("--id-field", metavar="NAME", help="jsonl: a field (string or integer) that identifies each "
                    "record; its values go to --ids")
    io.add_argument("--ids", metavar="FILE", help="also write one id a line, line i for row i: the --id-field "
                    "value, else the input line number (from 1); written atomically with --output")
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="PATH_OR_ID", help="a sentence-transformers or Hugging Face BERT folder, "
                       "or a Hub id in the local cache (default: the bundled all-MiniLM-L6-v2)")
    model.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the model's dtype (default: what the "
                       "folder says, else the checkpoint's own, as transformers' dtype='auto'); pooling runs in fp32")
    model.add_argument("--kernels", type=parse_kernels, default=None,
                       help="auto (default), torch, triton, or op=backend,...")
    add_format_options(model)
    model.add_argument("--no-cuda-graphs", action="store_true",
                       help="run the model eagerly on CUDA too (by default it replays CUDA graphs over token buckets)")
    pipe = parser.add_argument_group("how token vectors become one vector (each overrides the folder's setting)")
    pipe.add_argument("--pooling", type=_pooling, metavar="MODE[,MODE]",
                      help="cls, mean, max, mean_sqrt_len_tokens, weightedmean or lasttoken; several are concatenated")
    pipe.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                      help="L2-normalise each vector (sentence-transformers' Normalize module), or not")
    pipe.add_argument("--max-seq-length", type=count(1), metavar="N",
                      help="truncate each text to N tokens, special tokens included")
    pipe.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                      help="lowercase the texts before tokenizing (sentence-transformers' do_lower_case), or not")
    pipe.add_argument("--include-prompt", action=argparse.BooleanOptionalAction, default=None,
                      help="pool the prompt's tokens too, or leave them out (the Pooling config's include_prompt)")
    pipe.add_argument("--truncate-dim", type=count(1), metavar="N",
                      help="keep the first N dimensions of each vector (Matryoshka models), cut after the pipeline "
                           "as sentence-transformers' truncate_dim; past the vector's width: the whole vector")
    pipe.add_argument("--prompt", metavar="TEXT", help="a text put before every input text (\"\" turns off the "
                      "model's default prompt)")
    pipe.add_argument("--prompt-name", metavar="NAME", help="one of the model's prompts (config_sentence_"
                      "transformers.json), e.g. query or document")
    work = parser.add_argument_group("batching")
    work.add_argument("--max-tokens-per-batch", type=count(1), metavar="N",
                      help=f"texts are sorted by length and packed up to N real tokens per forward (the forward "
                           f"computes no padding; default {CPU_MAX_TOKENS_PER_BATCH:,} on a CPU, "
                           f"{DEFAULT_MAX_TOKENS_PER_BATCH:,} on a GPU)")
    work.add_argument("--batch-size", type=count(1), metavar="N",
                      help="at most N texts per forward (default: the token budget alone decides)")
    work.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it shows texts/s and tokens/s on a terminal, after one second)")
    ray = parser.add_argument_group(
        "Ray: a corpus bigger than one process (pip install 'ray[data]>=2.60')",
        "--input is then a .txt/.jsonl/.parquet file or a folder of them, --output a folder of Parquet shards "
        "(id, embedding) that a rerun resumes; every Ray node must be able to read both and the model.")
    add_ray_address(ray, "encode with a pool of Ray actors")
    ray.add_argument("--workers", type=count(1), metavar="N", help="actors, each with its own copy of the model "
                     "(default: one per GPU; on CPU, the cluster's CPUs / --cpus-per-worker)")
    ray.add_argument("--gpus-per-worker", type=fraction, metavar="X",
                     help="GPUs per actor (default 1; 0.5 puts two models on each GPU)")
    ray.add_argument("--cpus-per-worker", type=fraction, metavar="X",
                     help="CPUs per actor (default 1; on CPU they are its torch threads)")
    ray.add_argument("--rows-per-shard", type=count(1), metavar="N",
                     help="rows per Parquet shard: the unit of work and of resume (default 10000)")
    ray.add_argument("--overwrite", action="store_true",
                     help="replace another job's shards in --output (without it such a folder is refused)")
    return parser
