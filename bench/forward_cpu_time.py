"""A decoder embedder's forward in process CPU time (steadier than wall time when other jobs share the cores): its
encode folder (harness.decoder_st_folder) and the 16 texts of its encode cell (bench/test_bench_encode.py), then one
call each, first calls included: fastbert.encode and SentenceTransformer.encode; on the padded batch,
sentence-transformers' own transformers model, fastbert loaded from the folder, and fastbert built from that
transformers model (from_hf); the windows each side reads. The numbers it prints are in bench/RESULTS.md
(2026-12-07).

    python -m bench.forward_cpu_time [--model embeddinggemma-300m] [--root /tmp/forward-cpu-time]
"""
from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embeddinggemma-300m", help="qwen3-embedding-0.6b or embeddinggemma-300m")
    parser.add_argument("--root", default="/tmp/forward-cpu-time", help="where the folder is built (once)")
    args = parser.parse_args(argv)

    import sentence_transformers

    import fastbert
    from bench import harness

    torch.set_grad_enabled(False)
    path = harness.decoder_st_folder(args.root, args.model)
    st = sentence_transformers.SentenceTransformer(path, device="cpu")
    texts = harness.texts_of_lengths(st.tokenizer, harness._varlen(16, 64, 2048).lengths())
    enc = fastbert.SentenceEncoder.from_pretrained(path, device="cpu", dtype=torch.float32, kernels="torch")
    hf = st[0].auto_model
    from_hf = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    print(type(hf).__name__, hf.config._attn_implementation, "threads", torch.get_num_threads(),
          "HF sliding_window", getattr(hf.config, "sliding_window", None),
          "fastbert windows", [getattr(layer, "window", None) for layer in enc.model.layers], flush=True)

    def timed(name, call):
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        print(f"{name}: cpu {time.process_time() - cpu:.1f} s, wall {time.perf_counter() - wall:.1f} s", flush=True)

    batch = st.tokenizer(texts, padding=True, truncation=True, max_length=2048, return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.inference_mode():
        timed("fastbert.encode", lambda: enc.encode(texts, progress=False))
        timed("SentenceTransformer.encode", lambda: st.encode(texts, batch_size=32))
        timed("transformers forward, padded batch", lambda: hf(**batch))
        timed("fastbert (from the folder) forward", lambda: enc.model(ids, attention_mask=mask))
        timed("fastbert (from_hf) forward", lambda: from_hf(ids, attention_mask=mask))


if __name__ == "__main__":
    main()
