"""fastbert+PEFT LoRA step (bench/test_bench_lora.py's model, cell and step) with the twins' dropout as committed
("rand") against the same model with F.dropout and sdpa's own dropout patched back in ("bernoulli"), interleaved
round by round, the order flipping every round. Run from the repository root: python <this file> ROUNDS."""
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # the repository root, for `bench`
import fastbert  # noqa: E402
from bench import harness  # noqa: E402
from bench.test_bench_lora import CELL, lora, lora_classifier  # noqa: E402
from fastbert import twins  # noqa: E402

new = {"dropout": twins.dropout, "_sdpa": twins._sdpa}
old = {"dropout": lambda x, p: F.dropout(x, p) if p > 0 else x,
       "_sdpa": lambda q, k, v, m, p, s: F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, scale=s)}
config = harness.hf_config("bert-base")
config.num_labels, config._attn_implementation = 2, "sdpa"
model = lora(fastbert.optimize(lora_classifier(config), kernels="torch"))
batch = harness.make_batch(config, CELL, "cpu")
labels = torch.arange(CELL.batch) % 2
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
model.train()
times = {"rand": [], "bernoulli": []}
for r in range(int(sys.argv[1]) + 1):  # round 0: warm-up, not counted
    for name in (("rand", "bernoulli") if r % 2 else ("bernoulli", "rand")):
        for attr, f in (new if name == "rand" else old).items():
            setattr(twins, attr, f)
        t0 = time.perf_counter()
        model(**batch.inputs, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if r:
            times[name].append(time.perf_counter() - t0)
for name, t in times.items():
    print(name, "median %.3f s" % statistics.median(t), [round(x, 2) for x in t])
print("ratio bernoulli/rand %.3f" % (statistics.median(times["bernoulli"]) / statistics.median(times["rand"])))
print("per-round", [round(b / a, 3) for a, b in zip(times["rand"], times["bernoulli"])])
