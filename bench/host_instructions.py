"""Instructions a forward of the host-bound cell, counted by callgrind, for the working tree or any git revision.

The cell: a 12-layer BERT of hidden 32 (2 heads, intermediate 64, random weights) from `fastbert.AutoModel.from_hf`,
1 x 8 tokens, eval, inference mode, one thread. At that size a forward's cost is Python and dispatcher work on the
host, which the wall clock of a shared 2-core machine blurs; callgrind's instruction count does not. After 10 warm-up
forwards the instrumentation is switched on around `--forwards` forwards only.

    python bench/host_instructions.py                      # the working tree, fastbert
    python bench/host_instructions.py --rev 8098fcc --rev HEAD --runs 3
    python bench/host_instructions.py --model hf           # transformers' BertModel (sdpa), the same cell

A revision is exported with `git archive` into a temporary folder and imported from there (PYTHONPATH), so the
installed package is not what is measured. Needs valgrind (Debian: valgrind).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(model_kind: str, layers: int, forwards: int) -> None:
    """Under callgrind: build the cell, warm up, then wait on stdin while the parent switches counting on."""
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=64)
    hf = transformers.BertModel(cfg).eval()
    if model_kind == "fb":
        import fastbert
        model = fastbert.AutoModel.from_hf(hf).eval()
    else:
        model = hf
    ids = torch.randint(1, 1000, (1, 8))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        for _ in range(10):
            model(input_ids=ids, attention_mask=mask)
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range(forwards):
            model(input_ids=ids, attention_mask=mask)
        print("done", flush=True)
        sys.stdin.readline()


def count(pythonpath: str | None, model_kind: str, layers: int, forwards: int) -> float:
    """Instructions a forward, one callgrind run."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONHASHSEED="0")
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        cg = os.path.join(out, "cg.out")
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={cg}", sys.executable,
             os.path.abspath(__file__), "--child", model_kind, "--layers", str(layers), "--forwards", str(forwards)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, cwd=out)

        def expect(word: str) -> None:
            line = proc.stdout.readline().strip()
            if line != word:
                proc.kill()
                raise RuntimeError(f"callgrind child said {line!r}, expected {word!r}")

        expect("ready")
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        expect("done")
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait()
        with open(cg) as f:
            totals = next(int(m.group(1)) for line in f if (m := re.match(r"^totals:\s+(\d+)", line)))
    return totals / forwards


def export(rev: str, into: str) -> str:
    """The package at `rev` (fastbert/ and kernels/), unpacked into `into`; its path."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "fastbert", "kernels"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[], help="git revision to measure (repeatable); "
                        "default: the working tree")
    parser.add_argument("--model", choices=("fb", "hf"), default="fb")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--forwards", type=int, default=50)
    parser.add_argument("--runs", type=int, default=1, help="callgrind runs per revision, alternating revisions")
    parser.add_argument("--child", choices=("fb", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.layers, args.forwards)
        return
    revs = args.rev or [None]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {rev: export(rev, tempfile.mkdtemp(dir=tmp)) if rev else ROOT for rev in revs}
        results = {rev: [] for rev in revs}
        for _ in range(args.runs):
            for rev in revs:
                results[rev].append(count(paths[rev], args.model, args.layers, args.forwards))
    print(f"host-bound cell: BERT {args.layers} layers, hidden 32, 1x8 tokens, {args.model}, "
          f"{args.forwards} forwards after 10; instructions a forward")
    for rev in revs:
        runs = sorted(results[rev])
        median = runs[len(runs) // 2]
        print(f"{rev or 'working tree':>14}  median {median / 1e6:.3f} M   runs "
              + ", ".join(f"{r / 1e6:.3f}" for r in results[rev]))


if __name__ == "__main__":
    main()
