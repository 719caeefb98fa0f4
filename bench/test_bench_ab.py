"""Interleaved A/B on CPU: fastbert's PyTorch path and HF at its best (sdpa; eager for MPNet, which has no sdpa
path in transformers) timed alternately, round by round, in one test.

The grouped benchmarks time each variant in its own block of rounds, one after the other. On a shared 2-core CPU
the noise comes in bursts of seconds, so a burst that lands on one variant's block moves the ratio by +-10-25%
(seen here: 0.78x and 0.99x for the same code on two runs minutes apart). Alternating the two calls puts every
burst on both sides, so the ratio of medians holds still. The round timed by pytest-benchmark is one call of each;
the per-variant medians and their ratio are in extra_info. CPU only: on CUDA the grouped benchmarks are stable.

Cells (the CPU goals of padding-free execution):
  minilm 32x128          dense: no padding to remove, fastbert must not be slower (>= 0.95x)
  minilm 32xvar16-512    32 sequences of 16..512 tokens (fixed seed): HF computes 16,384 padded positions for
                         ~8,000 real tokens, fastbert only the real ones (goal >= 1.8x)
  host 1x8               a 12-layer BERT of hidden 32 at 8 tokens: compute is negligible, this is the host's cost
                         of one forward (goal >= 3x)
  distilbert-base 32xvar16-512, mpnet-base 32xvar16-512
                         the same ragged batch through the two other families of base size (random weights, the
                         shapes of distilbert-base-uncased and all-mpnet-base-v2), against HF sdpa and HF eager
  modernbert-base 16xvar64-2048, 4x8192
                         ModernBERT-base's shape against HF sdpa (its reference too: eager cannot hold 8,192^2
                         scores): 16 rows of 64..2,048 tokens (goal >= 2.5x), and 4 full rows of 8,192
  nomic-embed-base 32xvar16-512, gte-base 16xvar64-2048
                         nomic-embed-text-v1.5's and gte-base-en-v1.5's shapes (random weights; rotary post-norm,
                         gated MLPs) against HF sdpa: the ragged batch, and 16 rows of 64..2,048 (goals >= 2.5x)
  eurobert-210m 16xvar64-2048
                         EuroBERT-210m's shape (random weights; pre-norm RMSNorm, SwiGLU) against HF sdpa, 16 rows
                         of 64..2,048 (goal >= 2.5x)
  qwen3-embedding-0.6b 16xvar64-2048, embeddinggemma-300m 16xvar64-2048
                         the decoder embedders: Qwen3-Embedding-0.6B's layer geometry (causal, grouped key/value
                         heads of 128, q/k norms; 2 of its 28 layers) and EmbeddingGemma-300m's (bidirectional,
                         3 query heads over 1 key/value head of 256, windows of 512 on 5 of every 6 layers; 6 of its
                         24 layers), random weights, real vocabularies, against HF sdpa, 16 rows of 64..2,048 (goal
                         >= 1.8x or the cell's FLOP ratio, `harness.flop_ceiling`, in extra_info)
  deberta-v3-base 32xvar16-512
                         DeBERTa-v3-base's shape (random weights) against HF eager (it has no other attention): the
                         ragged batch, HF padding every row to 512 with its [B*nh, S, S] c2p/p2c gathers
"""
import statistics
import time

import pytest
import torch

from bench import harness

CASES = {  # id: (model, cell, rounds, warm-up rounds)
    "minilm-32x128": ("minilm", harness._fixed(32, 128), 15, 2),
    "minilm-32xvar16-512": ("minilm", harness._varlen(32, 16, 512), 9, 2),
    "host-1x8": ("host", harness._fixed(1, 8), 1000, 20),
    # base size: the reference and the check already ran (and warmed) both sides; a round of both takes tens of
    # seconds on 2 cores, so these few rounds keep each case near 3 minutes
    "distilbert-base-32xvar16-512": ("distilbert-base", harness._varlen(32, 16, 512), 5, 0),
    "mpnet-base-32xvar16-512": ("mpnet-base", harness._varlen(32, 16, 512), 3, 0),
    # ModernBERT-base: a round of both takes minutes on 2 cores (HF pads 16 rows to 2,048 and computes every local
    # layer's full 2,048 x 2,048 scores under its mask; 4 x 8,192 the same at 8,192)
    "modernbert-base-16xvar64-2048": ("modernbert-base", harness._varlen(16, 64, 2048), 2, 0),
    "modernbert-base-4x8192": ("modernbert-base", harness._fixed(4, 8192), 1, 0),
    "deberta-v3-base-32xvar16-512": ("deberta-v3-base", harness._varlen(32, 16, 512), 3, 0),
    "nomic-embed-base-32xvar16-512": ("nomic-embed-base", harness._varlen(32, 16, 512), 3, 0),
    "gte-base-16xvar64-2048": ("gte-base", harness._varlen(16, 64, 2048), 2, 0),
    "eurobert-210m-16xvar64-2048": ("eurobert-210m", harness._varlen(16, 64, 2048), 2, 0),
    "qwen3-embedding-0.6b-16xvar64-2048": ("qwen3-embedding-0.6b", harness._varlen(16, 64, 2048), 2, 0),
    "embeddinggemma-300m-16xvar64-2048": ("embeddinggemma-300m", harness._varlen(16, 64, 2048), 2, 0),
}


# Too slow for the one-pass check of `pytest bench --benchmark-disable` (CI): HF's reference forward alone is 100-190 s
SLOW_MODELS = ("modernbert-base", "deberta-v3-base", "nomic-embed-base", "gte-base", "eurobert-210m",
               *harness.DECODER_EMBEDDERS)


@pytest.mark.parametrize("case", list(CASES))
def test_ab_fastbert_torch_vs_hf_cpu(bank, benchmark, case):
    if torch.cuda.is_available():
        pytest.skip("the interleaved A/B is the CPU headline; on CUDA the grouped benchmarks are stable")
    model, cell, rounds, warmup = CASES[case]
    if benchmark.disabled and model in SLOW_MODELS:
        where = {"modernbert-base": "; the tiny stand-in of its code path is in bench/test_bench_tools.py"}
        pytest.skip(f"{model}'s cells take minutes a round on CPU: they run when benchmarking (without "
                    f"--benchmark-disable){where.get(model, '')}")
    baseline = harness.hf_variant(model)
    if benchmark.disabled:  # CI checks the case on a few rows of the cell; the timed runs take all of them
        cell = harness.ci_cell(cell)
    try:
        batch = bank.batch(model, cell, "cpu")
        variants = {"fastbert-torch": bank.fastbert(model, torch.float32, "cpu").set_kernels("torch"),
                    baseline: bank.hf(model, baseline.split("-", 1)[1], torch.float32, "cpu")}
        reference = bank.reference(model, cell, "cpu")
        bound = harness.accuracy_bound(torch.float32, bank.hf_error(model, cell, torch.float32, "cpu"))
    except harness.Unavailable as e:
        pytest.skip(str(e))
    with torch.inference_mode():
        for name, m in variants.items():  # check before timing
            if m is bank.hf(model, harness.reference_attention(model), torch.float32, "cpu"):
                continue  # the fp32 reference itself (MPNet's and ModernBERT's baseline): nothing to check
            error = harness.max_error(harness.Outputs.of(m(**batch.inputs), batch), reference)
            assert error <= bound, f"{name}: max |out - HF eager fp32| = {error:.3g} > {bound:.3g}; not timing it"

    times = {name: [] for name in variants}

    def one_round():  # alternates which variant goes first, so neither always runs on a warmer cache
        order = list(variants) if len(times[baseline]) % 2 else list(reversed(variants))
        with torch.inference_mode():
            for name in order:
                t0 = time.perf_counter()
                variants[name](**batch.inputs)
                times[name].append(time.perf_counter() - t0)

    benchmark.group = f"{model} {cell.name} fp32 cpu: interleaved A/B"
    if not benchmark.disabled:
        for _ in range(warmup):
            one_round()  # warm-up, not counted
        times = {name: [] for name in variants}
    benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else rounds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    benchmark.extra_info.update(
        kind="ab", model=model, cell=cell.name, dtype="fp32", device="cpu", rounds=len(times[baseline]),
        baseline=baseline, real_tokens=batch.real_tokens, padded_tokens=batch.padded_tokens,
        **{f"{name}_median_s": m for name, m in medians.items()},
        **{f"{name}_tokens_per_s": batch.real_tokens / m for name, m in medians.items()},
        **{f"ratio_fastbert_over_{baseline.replace('-', '_')}": medians[baseline] / medians["fastbert-torch"]},
        **harness.flop_ceiling(bank.master(model).config, cell.lengths()))
