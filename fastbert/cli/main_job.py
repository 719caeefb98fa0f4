"""python -m fastbert: the parity-and-speed check on a real model.

It loads the model (the bundled all-MiniLM-L6-v2 by default), encodes a fixed set of real sentences with Hugging
Face's BertModel and with fastbert on every backend available here (on a GPU through CUDA graphs, as users run it,
unless --no-cuda-graphs), prints one table, and exits 1 when fastbert misses the parity bar (fastbert.numerics:
fp32 max |delta| <= 1e-5 on real tokens; fp16/bf16 <= 2x HF's own error in that dtype against fp32).
"""
from __future__ import annotations

import time

import torch

from .. import dispatch, formats, quality
from ..graphs import GRAPH_CLASSES, graphed, stats_of
from ..modeling import BertModel
from ..numerics import error_bound, max_error
from .common import DTYPES, Parser, count, device_of, model_folder, parse_kernels

DESCRIPTION = ("python -m fastbert: the parity-and-speed check on a real model; python -m fastbert encode: sentence "
               "embeddings.")

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
    def rate(r):  # NaN when --repeats 0: nothing was timed
        return "-" if r != r else f"{r:.0f}"
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
    if dtype == torch.float32 and not isinstance(args.kernels, dict):
        failed |= formats_table(model, tokenizer, encodings, args, device, max_length)
    return 1 if failed else 0


def formats_table(model, tokenizer, encodings, args, device, max_length) -> bool:
    """The number formats side by side on this model: fastbert's tokens/s on the sentences in each, and what each
    costs against fp32 on the built-in sample (fastbert/quality.py: min cos of the mean-pooled vectors, agreement
    with fp32's ten nearest neighbours, each format's bar). -> True when a format measures under its bar."""
    texts = quality.sample_texts()

    def pooled(rows):
        out = []
        for _, enc in batches(tokenizer, rows, 64, device, max_length):
            out.append(mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]))
        return torch.cat(out)

    print(f"\nnumber formats (quantize=; GEMMs in the format, the rest fp32; cost on the built-in sample of "
          f"{len(texts)} texts against fp32):")
    header = f"{'format':<7} {'fastbert tok/s':>15} {'vs fp32':>8} {'min cos':>9} {'neighbours':>11}  verdict"
    print(header + "\n" + "-" * len(header))
    # the backend asked for (a format runs the GEMM ops in torch either way); on a CPU the torch path, as Triton
    # runs there only through its interpreter, too slow for the sample
    model.set_kernels("torch" if device.type == "cpu" else (args.kernels or "auto"))
    base, under = None, False
    for name in formats.FORMATS:
        model.set_format(name)
        quality.calibrate(model, pooled)  # int8's outlier channels, before it is timed
        with torch.inference_mode():
            _, tps = run(model, encodings, args.repeats)
            cost = None if name == "fp32" else quality.measure(model, pooled, "embedding", texts, "built-in sample")
        base = tps if base is None else base
        speed = "-" if tps != tps else f"{tps / base:.2f}x"
        if cost is None:
            print(f"{name:<7} {'-' if tps != tps else f'{tps:.0f}':>15} {speed:>8} {'1':>9} {'1':>11}  reference")
            continue
        below = cost.below_bar()
        under |= bool(below)
        print(f"{name:<7} {'-' if tps != tps else f'{tps:.0f}':>15} {speed:>8} {cost.min_cos:>9.5f} "
              f"{cost.neighbours:>11.4f}  " + ("ok" if not below else "UNDER BAR: " + ", ".join(below)))
    model.set_format("fp32")
    return under


def check_parser() -> Parser:
    parser = Parser(prog="python -m fastbert", description=DESCRIPTION,
                     epilog="python -m fastbert encode --help: the options of encode")
    parser.add_argument("command", nargs="?", choices=["check"], default="check")
    parser.add_argument("--model", help="local folder or Hub id (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch-size", type=count(1), default=8)
    parser.add_argument("--kernels", type=parse_kernels, default=None,
                        help="auto, torch, triton, or op=backend,... (default: every available backend in turn)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run fastbert eagerly on CUDA too (by default it replays CUDA graphs, as encode does)")
    parser.add_argument("--repeats", type=count(0), default=3, help="timed passes over the sentences")
    parser.add_argument("--limit", type=count(0), default=0, help="use only the first N built-in sentences (0 = all)")
    return parser
