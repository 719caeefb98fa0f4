"""What one encoder layer keeps alive for its backward: HF BertModel (sdpa) against fastbert on its twins and on its
kernels, BERT-base in fp32 on CPU.

    python -m bench.saved_bytes [--batch 32] [--seq 512] [--kernel-batches 2,4] [--json OUT.json]
    python -m bench.saved_bytes --tiny            a small BERT at small shapes (what bench/test_bench_tools.py runs)

Training memory is mostly what the forward saves for the backward. Every tensor autograd saves goes through
`torch.autograd.graph.saved_tensors_hooks`' pack hook; this sums the bytes of the distinct storages it sees (a view
pins its whole storage: q, k and v sliced from one [T, 3, nh, hd] GEMM output are one storage), leaving out the
parameters' and buffers' storages (fastbert's query/key/value weights are views of its fused W_qkv, also a
parameter's storage). A tensor a custom autograd Function keeps as a plain ctx attribute bypasses the hook: the units'
Functions keep only Python values there.

One layer = the forward of a 2-layer model minus that of a 1-layer model of the same weights (embeddings and pooler
cancel out), on `--batch` sequences of `--seq` real tokens, in train mode: once with the config's dropout (0.1, as
fine-tuning runs) and once with dropout 0. Variants: hf-sdpa (transformers' BertModel, attn_implementation="sdpa"),
fastbert-torch (kernels="torch"), fastbert-triton (kernels="triton" under TRITON_INTERPRET=1). The interpreter is too
slow for 32 x 512, so the kernel path is measured at `--kernel-batches` sequences of `--seq` tokens (and HF and the
twins at those too): the bytes per token at each size show the saved bytes are linear in the tokens, and the
32 x 512 figure of the kernel path is its bytes per token times the tokens (said so in the table). fastbert-triton
reports which ops ran their kernels, as its dispatch resolves a training forward (`resolve_ops(needs_grad=True)`);
where the dispatch refuses kernels="triton" under autograd, the row says why and is measured with kernels="auto"
(the kernel where the dispatch lets it, the twin elsewhere), so the figure is honest either way.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on CPU

import torch  # noqa: E402

VARIANTS = ("hf-sdpa", "fastbert-torch", "fastbert-triton")
GOAL = 0.6  # the kernel path's saved bytes per layer, at most this fraction of HF sdpa's


def bert_config(tiny: bool, layers: int, dropout: float):
    import transformers

    shape = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=64) if tiny else {}  # BERT-base: the config's defaults
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout, **shape)
    config._attn_implementation = "sdpa"
    return config


def models(tiny: bool, dropout: float) -> dict:
    """layers (1, 2) -> the HF master with that many layers (seeded; the 1-layer one holds the 2-layer one's first
    layer, embeddings and pooler)."""
    import transformers

    torch.manual_seed(0)
    two = transformers.BertModel(bert_config(tiny, 2, dropout)).float()
    one = transformers.BertModel(bert_config(tiny, 1, dropout)).float()
    state = {k: v for k, v in two.state_dict().items() if ".layer.1." not in k}
    one.load_state_dict(state)
    return {1: one, 2: two}


def build(variant: str, master) -> tuple:
    """(the model `variant` runs, its note): HF as it is, or fastbert built from it (BertModel.from_hf)."""
    if variant == "hf-sdpa":
        return copy.deepcopy(master).train(), None
    import fastbert

    backend = variant.split("-", 1)[1]
    return fastbert.BertModel.from_hf(copy.deepcopy(master), kernels=backend).train(), None


def kernel_ops(model, tokens: int, seq: int) -> tuple[list | None, str | None, object]:
    """(the ops that run their kernels in a training forward, why kernels="triton" was refused or None, the model
    to measure): HF -> (None, None, model)."""
    if not hasattr(model, "resolve_ops"):
        return None, None, model
    try:
        return sorted(model.resolve_ops(needs_grad=True, tokens=tokens, max_seqlen=seq).triton), None, model
    except RuntimeError as e:
        if set(model.kernels.values()) != {"triton"}:
            raise
        import warnings

        model.set_kernels("auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "auto" says once per op why it keeps the twin: the row says it
            run = model.resolve_ops(needs_grad=True, tokens=tokens, max_seqlen=seq)
        return sorted(run.triton), str(e), model


def saved_bytes(model, inputs: dict) -> int:
    """Bytes of the distinct storages autograd saves during one forward of `model`, parameters and buffers left
    out."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        # A view without autograd history: it keeps the storage alive (so storages stay distinct until the sum is
        # taken), and unlike t itself it does not tie a saved output to its own grad_fn, a reference cycle through
        # autograd's C++ nodes that no collector frees (each forward's saved tensors would then stay in memory)
        return t.detach()

    with torch.inference_mode(False), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    total = sum(seen.values())
    del out
    return total


def per_layer(variant: str, masters: dict, batch: int, seq: int) -> dict:
    """One layer's saved bytes (2 layers minus 1) of `variant` on `batch` x `seq` real tokens."""
    vocab = masters[1].config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(min(1000, vocab // 2), vocab, (batch, seq), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    tokens = batch * seq
    totals, ops, refused = {}, None, None
    for layers, master in masters.items():
        model, _ = build(variant, master)
        ops, refused, model = kernel_ops(model, tokens, seq)
        torch.manual_seed(2)
        totals[layers] = saved_bytes(model, inputs)
        del model
    layer = totals[2] - totals[1]
    return {"variant": variant, "batch": batch, "seq": seq, "tokens": tokens, "bytes_per_layer": layer,
            "bytes_per_token": layer / tokens, "kernel_ops": ops, "triton_refused": refused,
            "model_bytes": totals}


def measure(tiny: bool, batch: int, seq: int, kernel_batches: list[int]) -> dict:
    """Every variant with and without dropout: HF and the twins at batch x seq and at each kernel batch; the
    kernel path at the kernel batches, extrapolated to batch x seq by its bytes per token."""
    rows = []
    for dropout in (0.1, 0.0):
        masters = models(tiny, dropout)
        for variant in VARIANTS:
            sizes = kernel_batches if variant == "fastbert-triton" else sorted({*kernel_batches, batch})
            for b in sizes:
                rows.append({"dropout": dropout, **per_layer(variant, masters, b, seq)})
                r = rows[-1]
                print(f"  {variant:<16} dropout {dropout}  {b:>3} x {seq}: {r['bytes_per_layer'] / 2**20:9.2f} MiB "
                      f"per layer, {r['bytes_per_token']:9.1f} B per token", flush=True)
    return {"rows": rows, "table": table(rows, batch, seq)}


def fit(rows: list[dict]) -> tuple[float, float]:
    """(bytes per token, constant bytes per layer): the line through the smallest and the largest size measured
    (the constant is what does not grow with the tokens, e.g. a fused weight built for autograd)."""
    a, b = min(rows, key=lambda r: r["tokens"]), max(rows, key=lambda r: r["tokens"])
    if a is b:
        return a["bytes_per_token"], 0.0
    slope = (b["bytes_per_layer"] - a["bytes_per_layer"]) / (b["tokens"] - a["tokens"])
    return slope, a["bytes_per_layer"] - slope * a["tokens"]


def table(rows: list[dict], batch: int, seq: int) -> list[dict]:
    """Per (dropout, variant): bytes per layer at batch x seq (measured, or from the line through the kernel
    batches), the line's bytes per token and constant, how far the line through the kernel batches misses the
    measured batch x seq figure (the linearity the kernel path's extrapolation rests on), the ratio to HF sdpa, the
    ops on kernels."""
    out = []
    tokens = batch * seq
    for dropout in sorted({r["dropout"] for r in rows}, reverse=True):
        hf = None
        for variant in VARIANTS:
            mine = [r for r in rows if r["dropout"] == dropout and r["variant"] == variant]
            full = next((r for r in mine if r["batch"] == batch), None)
            small = [r for r in mine if r is not full] or mine
            slope, constant = fit(small)
            line = constant + slope * tokens
            value = full["bytes_per_layer"] if full else line
            hf = value if variant == "hf-sdpa" else hf
            sizes = ", ".join(f"{r['batch']}x{seq}" for r in small)
            how = "measured" if full else f"the line through {sizes}"
            out.append({"dropout": dropout, "variant": variant, "bytes_per_layer": value, "how": how,
                        "bytes_per_token": slope, "constant_bytes": constant,
                        "line_misses_by": None if full is None or full in small else value / line - 1,
                        "measured": {f"{r['batch']}x{seq}": r["bytes_per_layer"] for r in mine},
                        "vs_hf_sdpa": value / hf if hf else None, "kernel_ops": mine[-1]["kernel_ops"],
                        "triton_refused": mine[-1]["triton_refused"]})
    return out


def render(result: dict, batch: int, seq: int) -> str:
    lines = [f"Saved for backward, one BERT layer, fp32 CPU, {batch} x {seq} tokens, train mode (goal: kernel path "
             f"<= {GOAL}x HF sdpa)", "",
             "| dropout | variant | MiB per layer | bytes per token | constant KiB | line through the small sizes "
             "misses by | vs HF sdpa | ops on kernels | how |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        ops = "–" if r["kernel_ops"] is None else (", ".join(r["kernel_ops"]) or "none")
        if r["triton_refused"]:
            ops += f" (kernels='triton' refused: {r['triton_refused']}; measured with 'auto')"
        misses = "–" if r["line_misses_by"] is None else f"{r['line_misses_by']:+.2%}"
        lines.append(f"| {r['dropout']} | {r['variant']} | {r['bytes_per_layer'] / 2**20:,.1f} | "
                     f"{r['bytes_per_token']:,.0f} | {r['constant_bytes'] / 2**10:,.1f} | {misses} | "
                     f"{r['vs_hf_sdpa']:.2f}x | {ops} | {r['how']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--kernel-batches", default="2,4", help="sequences the interpreted kernel path runs")
    parser.add_argument("--tiny", action="store_true", help="a small BERT (hidden 64, 4 heads) instead of BERT-base")
    parser.add_argument("--json", default=None, help="write the rows and the table here")
    args = parser.parse_args(argv)
    kernel_batches = [int(b) for b in args.kernel_batches.split(",") if b]
    torch.manual_seed(0)
    result = measure(args.tiny, args.batch, args.seq, kernel_batches)
    result["conditions"] = {"device": "cpu", "dtype": "fp32", "model": "tiny BERT" if args.tiny else "BERT-base",
                            "batch": args.batch, "seq": args.seq, "kernel_batches": kernel_batches,
                            "one_layer": "forward of 2 layers minus forward of 1 layer, same weights",
                            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "torch": torch.__version__,
                            "goal": f"kernel path <= {GOAL}x HF sdpa"}
    text = render(result, args.batch, args.seq)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
