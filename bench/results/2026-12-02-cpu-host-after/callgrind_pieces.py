"""Instructions per call of each piece of the host-bound cell's forward, under callgrind, counted by the process
itself through callgrind's client requests (cgctl.c): after warm-up, N calls of each piece, then a dump named after
it. A 12-layer BERT of hidden 32 (random weights), 1x8 tokens, one thread, inference mode.

usage (from the repository root; PYTHONPATH picks the build to measure):
    gcc -O2 -shared -fPIC -o /tmp/libcgctl.so bench/results/2026-12-02-cpu-host-after/cgctl.c
    PYTHONPATH=<build> python bench/results/2026-12-02-cpu-host-after/callgrind_pieces.py
It runs itself under valgrind and prints one line a piece."""
import ctypes
import glob
import os
import subprocess
import sys

N, WARM = 100, 20


def measure():
    import torch
    import transformers

    import fastbert
    from fastbert.inputs import prepare

    lib = ctypes.CDLL(os.environ.get("CGCTL", "/tmp/libcgctl.so"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                                  intermediate_size=64)
    m = fastbert.AutoModel.from_hf(transformers.BertModel(cfg)).eval()
    ids = torch.randint(1, 1000, (1, 8))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        b = prepare(m, ids, mask, None, None, None, False, None, None)
        run = m.resolve_ops(False, b.why_padded(False), *b.size)
        args = (b.input_ids, b.token_type_ids, b.position_ids, b.attn, run, b.inputs_embeds, None, False)
        x, hs, at = m.encode(*args)
        layer = m.encoder.layer[0]
        h = torch.randn(8, 32)
        pieces = {
            "prepare": lambda: prepare(m, ids, mask, None, None, None, False, None, None),
            "resolve_ops": lambda: m.resolve_ops(False, b.why_padded(False), *b.size),
            "encode": lambda: m.encode(*args),
            "embeddings": lambda: m.embeddings(b.input_ids, b.token_type_ids, b.position_ids, None),
            "one layer (module call)": lambda: layer(h, b.attn, run, False),
            "finish": lambda: m.finish(b, x, hs, at, False, False),
            "forward": lambda: m(input_ids=ids, attention_mask=mask),
        }
        for fn in pieces.values():
            for _ in range(WARM):
                fn()
        lib.cg_start()
        for name, fn in pieces.items():
            for _ in range(N):
                fn()
            lib.cg_dump(name.encode())
        lib.cg_stop()


if __name__ == "__main__":
    if os.environ.get("UNDER_CALLGRIND"):
        measure()
        sys.exit(0)
    out = "/tmp/cg-pieces.out"
    for f in glob.glob(out + "*"):
        os.remove(f)
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    sys.executable, __file__], env={**os.environ, "UNDER_CALLGRIND": "1"}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for f in sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1])):
        lines = open(f).read().splitlines()
        name = next(line.split("Client Request: ")[-1] for line in lines if line.startswith("desc: Trigger"))
        total = next(int(line.split()[1]) for line in lines if line.startswith(("totals:", "summary:")))
        print(f"{name:28s} {total / N:12,.0f}")
