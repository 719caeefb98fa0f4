"""Instructions of each part of the host-bound cell's forward, under callgrind (run by callgrind_parts.sh): prepare,
resolve_ops, encode, finish and the whole forward, 50 calls each, with a callgrind dump after each part.
usage: python callgrind_parts.py TAG
"""
import os
import sys
import time

import torch
import transformers

import fastbert
from fastbert.inputs import prepare

N = 50
torch.manual_seed(0)
torch.set_num_threads(1)
cfg = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=12, num_attention_heads=2,
                              intermediate_size=64)
m = fastbert.AutoModel.from_hf(transformers.BertModel(cfg)).eval()
ids = torch.randint(1, 1000, (1, 8))
mask = torch.ones_like(ids)
tag = sys.argv[1]


def sync(name):
    """Tell the driver a part is done, and wait for its dump."""
    with open(f"/tmp/ph-{tag}.{name}", "w") as f:
        f.write("1")
    while not os.path.exists(f"/tmp/ph-{tag}.{name}.ok"):
        time.sleep(0.02)


def repeat(fn):
    for _ in range(N):
        fn()


with torch.inference_mode():
    for _ in range(10):
        m(input_ids=ids, attention_mask=mask)
    batch = prepare(m, ids, mask, None, None, None, False, None, None)
    run = m.resolve_ops(False, batch.why_padded(False), *batch.size)
    args = (batch.input_ids, batch.token_type_ids, batch.position_ids, batch.attn, run, batch.inputs_embeds, None,
            False)
    x, hs, at = m.encode(*args)
    sync("start")
    repeat(lambda: prepare(m, ids, mask, None, None, None, False, None, None))
    sync("prepare")
    repeat(lambda: m.resolve_ops(False, batch.why_padded(False), *batch.size))
    sync("resolve")
    repeat(lambda: m.encode(*args))
    sync("encode")
    repeat(lambda: m.finish(batch, x, hs, at, False, False))
    sync("finish")
    repeat(lambda: m(input_ids=ids, attention_mask=mask))
    sync("forward")
