"""Embedding a corpus: fastbert.encode against SentenceTransformer.encode, the same model, texts and device, in one run.

The corpus is real text no one here wrote and of mixed lengths: the descriptions (METADATA) and licence files of
the Python distributions installed next to fastbert, split into paragraphs (5 to thousands of tokens; longer ones
are cut at max_seq_length as both libraries cut them). Each variant is checked against sentence-transformers before
anything is timed (fp32: cosine >= 0.99999 for every text; fp16/bf16: at most twice sentence-transformers' own error
in that dtype against its fp32). Then rounds alternate between the two (as in test_bench_ab.py, so bursts of noise
on a shared machine land on both); the headline is texts/s (wall clock), with real tokens/s, the process CPU time
(steadier than wall time when other jobs share the cores) and the tokens each one computes (padding included) in
extra_info.

Both run as users run them: sentence-transformers with its defaults (batches of 32 texts, sorted by characters),
fastbert with its defaults (sorted by tokens, batches of up to 16,384 real tokens, padding-free: it computes the
real tokens only, sentence-transformers each batch padded to its longest text).
With --benchmark-disable (CI) a small slice of the corpus is checked and encoded once per side.

The decoder embedders (Qwen3-Embedding-0.6B's and EmbeddingGemma-300m's layer geometry, 2 of 28 and 6 of 24 layers:
bench/harness.py hf_config; their folders as the Hub lays them out, harness.decoder_st_folder) encode 16 texts of
64..2,048 tokens, the lengths of the A/B cell 16xvar64-2048 (the corpus's text cut to them), no prompt: one
sentence-transformers batch padded to its longest, against fastbert's padding-free batches; the cell's FLOP ratio
(harness.flop_ceiling, from the lengths computed) is in extra_info.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from bench import harness
from bench.conftest import skip_reason_for_device

# device, dtype, texts, model: the bundled MiniLM folder, or a nomic-embed-text-v1.5-shaped one encoding with its
# "search_document: " prompt
CASES = [("cpu", "fp32", 512, "minilm"), ("cuda", "fp16", 8192, "minilm"), ("cuda", "bf16", 8192, "minilm"),
         ("cpu", "fp32", 256, "nomic-embed-base"), ("cpu", "fp32", 16, "qwen3-embedding-0.6b"),
         ("cpu", "fp32", 16, "embeddinggemma-300m")]
DECODER_CELL = harness._varlen(16, 64, 2048)  # the decoder embedders' texts: the lengths of their A/B cell
DECODER_ROUNDS = 2  # a round of both takes about a minute on 2 cores; the check already warmed both sides
CI_TEXTS = 48
CI_TEXTS_BASE = 8  # a base-size model's check in CI
ROUNDS = {"cpu": 5, "cuda": 10}
ST_BATCH_SIZE = 32  # SentenceTransformer.encode's default


def computed_tokens(lengths: list[int], batches: list[list[int]], padding: bool = True) -> int:
    """Tokens a forward computes over these batches: a padded one, each batch as long as its longest text; a
    padding-free one, the real tokens."""
    if not padding:
        return sum(lengths[i] for b in batches for i in b)
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


@pytest.mark.parametrize("device, dtype, size, model", CASES,
                         ids=[f"{d}-{t}" + ("" if m == "minilm" else f"-{m}") for d, t, _, m in CASES])
def test_encode_corpus(device, dtype, size, model, benchmark, request, tmp_path_factory):
    reason = skip_reason_for_device(request.config, device)
    if reason:
        pytest.skip(reason)
    import fastbert
    from fastbert.encode import default_max_tokens_per_batch, plan_batches
    sentence_transformers = pytest.importorskip("sentence_transformers")

    torch_dtype = harness.DTYPES[dtype]
    try:
        root = tmp_path_factory.getbasetemp()
        decoder = model in harness.DECODER_EMBEDDERS
        path = str(harness.minilm_path()) if model == "minilm" else \
            harness.decoder_st_folder(root, model) if decoder else harness.nomic_st_folder(root)
        if decoder:
            cell = harness.ci_cell(DECODER_CELL) if benchmark.disabled else DECODER_CELL
            texts = harness.texts_of_lengths(sentence_transformers.SentenceTransformer(path).tokenizer,
                                             cell.lengths())
        else:
            texts = harness.corpus((CI_TEXTS if model == "minilm" else CI_TEXTS_BASE) if benchmark.disabled else size)
    except harness.Unavailable as e:
        pytest.skip(str(e))
    prompt = {"prompt_name": "document"} if model == "nomic-embed-base" else {}
    # on CPU the PyTorch path: "auto" would take Triton's interpreter where TRITON_INTERPRET=1 is set
    encoder = fastbert.SentenceEncoder.from_pretrained(path, device=device, dtype=torch_dtype,
                                                       kernels="torch" if device == "cpu" else "auto")
    st = sentence_transformers.SentenceTransformer(path, device=device, model_kwargs={"dtype": torch_dtype})
    variants = {"fastbert": lambda: encoder.encode(texts, progress=False, **prompt),
                "sentence-transformers": lambda: st.encode(texts, batch_size=ST_BATCH_SIZE,
                                                                 show_progress_bar=False, **prompt)}

    # Check before timing (the first calls also pay one-time costs: Triton autotuning, allocator growth)
    started = time.perf_counter()
    ours = variants["fastbert"]()
    first_call_s = time.perf_counter() - started
    theirs = variants["sentence-transformers"]().astype(np.float32)
    if torch_dtype == torch.float32:
        error = float(harness.one_minus_cosine(ours, theirs).max())
        bound = 1 - harness.COSINE
    else:
        reference = sentence_transformers.SentenceTransformer(path, device=device).encode(texts, **prompt)
        error = float(harness.one_minus_cosine(ours, reference).max())
        bound = 2 * float(harness.one_minus_cosine(theirs, reference).max()) + 1e-6
    assert error <= bound, f"fastbert vs sentence-transformers: 1 - cosine = {error:.3g} > {bound:.3g}; not timed"

    times = {name: [] for name in variants}
    cpu_times = {name: [] for name in variants}  # process CPU seconds: steadier than wall time on a shared CPU

    def one_round():  # alternates which side goes first
        order = list(variants) if len(times["fastbert"]) % 2 == 0 else list(reversed(variants))
        for name in order:
            if device == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name]()  # returns host arrays: the work is done when it returns
            times[name].append(time.perf_counter() - t0)
            cpu_times[name].append(time.process_time() - c0)

    benchmark.group = f"encode a corpus: {model} {dtype} {device}"
    rounds = DECODER_ROUNDS if decoder else ROUNDS[device]
    benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else rounds,
                       warmup_rounds=0 if benchmark.disabled or decoder else 1)
    kept = 1 if benchmark.disabled else rounds  # the warm-up round is dropped
    timed = {name: t[-kept:] for name, t in times.items()}
    medians = {name: statistics.median(t) for name, t in timed.items()}
    cpu_medians = {name: statistics.median(t[-kept:]) for name, t in cpu_times.items()}

    prefix = encoder.resolve_prompt(None, prompt.get("prompt_name"))
    lengths = [len(x) for x in encoder.tokenizer([prefix + t for t in texts], truncation=True,
                                                 max_length=encoder.pipeline.max_seq_length)["input_ids"]]
    by_chars = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # sentence-transformers sorts by characters
    benchmark.extra_info.update(
        kind="encode", model=model, dtype=dtype, device=device, device_name=harness.device_name(device),
        texts=len(texts), real_tokens=sum(lengths), max_seq_length=encoder.pipeline.max_seq_length,
        rounds=len(timed["fastbert"]), round_s=timed, first_call_s=first_call_s, max_one_minus_cosine=error,
        bound=bound, sentence_transformers_batch_size=ST_BATCH_SIZE,
        fastbert_max_tokens_per_batch=default_max_tokens_per_batch(device),
        computed_tokens={
            "fastbert": computed_tokens(lengths, plan_batches(lengths, default_max_tokens_per_batch(device),
                                                              count_padding=False), padding=False),
            "sentence-transformers": computed_tokens(lengths, [by_chars[i:i + ST_BATCH_SIZE]
                                                              for i in range(0, len(texts), ST_BATCH_SIZE)])},
        **{f"{name}_median_s": m for name, m in medians.items()},
        **{f"{name}_texts_per_s": len(texts) / m for name, m in medians.items()},
        **{f"{name}_tokens_per_s": sum(lengths) / m for name, m in medians.items()},
        ratio_fastbert_over_sentence_transformers=medians["sentence-transformers"] / medians["fastbert"],
        round_cpu_s={name: t[-kept:] for name, t in cpu_times.items()},
        cpu_time_ratio_fastbert_over_sentence_transformers=(cpu_medians["sentence-transformers"]
                                                            / cpu_medians["fastbert"]))
    if decoder:  # one sentence-transformers batch (16 texts): the cell's FLOP ratio over its computed lengths
        benchmark.extra_info.update(harness.flop_ceiling(harness.hf_config(model), lengths))
