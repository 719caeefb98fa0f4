"""python -m fastbert quality: what a number format or dtype costs on a model, against fp32.

    python -m fastbert quality [MODEL] [--quantize bf16|int8] [--dtype bfloat16|float16]
                               [--quality-texts FILE] [--pairs FILE.tsv]

Encodes the texts (a file, one per line; default: the built-in sample) with the fp32 model and with the one asked
for, and prints min cos and neighbour agreement (fastbert/quality.py). --pairs adds a labelled retrieval task:
one "query<TAB>relevant text" per line; every relevant text is a document, each query is scored by MRR@10 among
them, in fp32 and in the format.
"""
from __future__ import annotations

import sys
import time

import torch

from .. import formats, quality
from ..encode import SentenceEncoder
from .common import DTYPES, Parser, UsageError, add_format_options, default_model, device_of, parse_kernels


def read_pairs(path: str) -> tuple[list[str], list[str], list[int]]:
    """(queries, documents, relevant document of each query) from "query<TAB>text" lines."""
    queries, documents, relevant, index = [], [], [], {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                raise UsageError(f"--pairs {path}: line {number} is not 'query<TAB>relevant text'")
            query, text = parts[0].strip(), parts[1].strip()
            if text not in index:
                index[text] = len(documents)
                documents.append(text)
            queries.append(query)
            relevant.append(index[text])
    if len(documents) < 10:
        raise UsageError(f"--pairs {path}: {len(documents)} distinct texts; MRR@10 needs at least 10")
    return queries, documents, relevant


def quality_command(args) -> int:
    if args.quantize in (None, "fp32") and args.dtype in (None, "float32", "fp32"):
        raise UsageError("give --quantize bf16|int8 or --dtype bfloat16|float16: the format to compare with fp32")
    texts, source = quality.quality_texts(args.quality_texts)
    texts, source = (quality.sample_texts(), "built-in sample") if texts is None else (texts, source)
    pairs = read_pairs(args.pairs) if args.pairs else None
    model, device = args.model or default_model(), str(device_of(args))
    reference = SentenceEncoder.from_pretrained(model, device=device, dtype=torch.float32, kernels=args.kernels)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.quantize not in (None, "fp32"):
        dtype = formats.load_dtype(args.quantize, dtype)
    candidate = SentenceEncoder.from_pretrained(model, device=device, dtype=dtype, kernels=args.kernels)
    asked = " ".join(f"--{k} {v}" for k, v in (("dtype", args.dtype), ("quantize", args.quantize)) if v)

    def encode(encoder, rows):
        return torch.from_numpy(encoder.encode(rows, progress=False))

    # measured below, on the same texts; calibrated first (int8's outlier channels) as every loading surface does
    candidate.model.set_format(args.quantize)
    quality.calibrate(candidate.model, lambda rows: encode(candidate, rows))

    started = time.perf_counter()
    ref, got = encode(reference, texts), encode(candidate, texts)
    print(f"model: {model}  device: {device}  {asked}  texts: {len(texts)} ({source})")
    print(f"{'min cos':>10} {'neighbours@10':>14}")
    cos, near = quality.min_cos(ref, got), quality.neighbours(ref, got)
    bars = quality.BARS.get(formats.ALIASES.get(args.quantize) or "", {})
    verdict = "" if not bars else "  " + ("ok" if cos >= bars["min_cos"] and near >= bars["neighbours"] else
                                          "UNDER BAR") + f" (bars: {bars['min_cos']}, {bars['neighbours']})"
    print(f"{cos:>10.6f} {near:>14.4f}{verdict}")
    if pairs is not None:
        queries, documents, relevant = pairs
        fp32 = quality.mrr_at_10(encode(reference, queries), encode(reference, documents), relevant)
        fmt = quality.mrr_at_10(encode(candidate, queries), encode(candidate, documents), relevant)
        print(f"retrieval ({args.pairs}: {len(queries)} queries, {len(documents)} texts): MRR@10 fp32 {fp32:.4f}, "
              f"{asked} {fmt:.4f} ({fmt / fp32 if fp32 else float('nan'):.4f} of fp32's)")
    print(f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


def quality_parser() -> Parser:
    parser = Parser(prog="python -m fastbert quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="a sentence-transformers or Hugging Face folder, or a cached Hub id "
                        "(default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the whole model in this dtype (transformers' meaning), against float32")
    parser.add_argument("--kernels", type=parse_kernels, default="auto",
                        help="auto, torch, triton, or op=backend,... (a format runs its GEMM ops on torch)")
    add_format_options(parser)
    parser.add_argument("--pairs", metavar="FILE.tsv", help="query<TAB>relevant text per line: adds MRR@10")
    return parser
