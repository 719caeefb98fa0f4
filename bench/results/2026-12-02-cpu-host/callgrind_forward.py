"""Instructions per forward of the host-bound cell, under callgrind (run by callgrind_forward.sh).

A 12-layer BERT of hidden 32 (NL= sets the layer count) at 1x8 tokens, one thread; after 10 warm-up forwards the
script waits for callgrind's instrumentation to be switched on, runs 50 forwards, and says so.
usage: python callgrind_forward.py fb|hf TAG
"""
import os
import sys
import time

import torch
import transformers

import fastbert


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.05)


torch.manual_seed(0)
torch.set_num_threads(1)
cfg = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=int(os.environ.get("NL", "12")),
                              num_attention_heads=2, intermediate_size=64)
hf = transformers.BertModel(cfg).eval()
model = fastbert.AutoModel.from_hf(hf).eval() if sys.argv[1] == "fb" else hf
tag = sys.argv[2]
ids = torch.randint(1, 1000, (1, 8))
mask = torch.ones_like(ids)
with torch.inference_mode():
    for _ in range(10):
        model(input_ids=ids, attention_mask=mask)
    with open(f"/tmp/cg-{tag}.ready", "w") as f:
        f.write(str(os.getpid()))
    wait_for(f"/tmp/cg-{tag}.go")
    for _ in range(50):
        model(input_ids=ids, attention_mask=mask)
    with open(f"/tmp/cg-{tag}.done", "w") as f:
        f.write("1")
    wait_for(f"/tmp/cg-{tag}.end")
