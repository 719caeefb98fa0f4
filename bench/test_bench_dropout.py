"""Train-mode dropout on CPU, forward + backward, interleaved A/B: fastbert.twins.dropout against F.dropout, at the
shapes a BERT-base LoRA step (bench/test_bench_lora.py) drops: hidden states [2167, 768] and one layer's attention
probabilities [1, 12, L, L] of its 16 sequences (L in 16..256, the same lengths). Also one layer's attention with
dropout on the probabilities: the twin (softmax, dropout and the products in torch) against one sdpa per sequence with
dropout_p, the path sdpa takes on CPU being its math fallback. Variants alternate round by round, the order flipping
every round; the medians go to extra_info.
"""
import statistics
import time

import pytest
import torch
import torch.nn.functional as F

from bench import harness
from fastbert import ops, twins
from fastbert.layout import TokenLayout

P = 0.1
CELL = harness._varlen(16, 16, 256)
ROUNDS = 21


def _hidden():
    x = torch.randn(sum(CELL.lengths()), 768, requires_grad=True)
    return [x], {"F.dropout": lambda: [F.dropout(x, P)], "fastbert": lambda: [twins.dropout(x, P)]}


def _probs():
    xs = [torch.rand(1, 12, L, L, requires_grad=True) for L in CELL.lengths()]
    return xs, {"F.dropout": lambda: [F.dropout(x, P) for x in xs],
                "fastbert": lambda: [twins.dropout(x, P) for x in xs]}


def _attention():
    lengths = CELL.lengths()
    qkv = torch.randn(sum(lengths), 3, 12, 64, requires_grad=True)
    layout = TokenLayout.from_cu_seqlens(torch.tensor([0] + lengths).cumsum(0).to(torch.int32), max(lengths),
                                         lengths)

    def sdpa():  # one sdpa per sequence with its own dropout: the math fallback on CPU
        out = []
        for piece in qkv.split(lengths):
            q, k, v = piece.unsqueeze(0).permute(2, 0, 3, 1, 4).unbind(0)
            out.append(F.scaled_dot_product_attention(q, k, v, dropout_p=P, scale=0.125)[0].transpose(0, 1))
        return [torch.cat(out).view(qkv.shape[0], 768)]

    return [qkv], {"sdpa dropout_p": sdpa,
                   "fastbert": lambda: [ops.attention_varlen_torch(qkv, layout, 0.125, dropout_p=P)]}


CASES = {"hidden-2167x768": _hidden, "probs-1x12xLxL-16xvar16-256": _probs,
         "attention-layer-16xvar16-256": _attention}


@pytest.mark.parametrize("case", list(CASES))
def test_dropout_forward_backward_cpu(benchmark, case):
    if torch.cuda.is_available():
        pytest.skip("the CPU figure; on CUDA fastbert.twins.dropout is F.dropout")
    with torch.inference_mode(False), torch.enable_grad():  # bench/conftest.py runs every benchmark in inference mode
        _ab(benchmark, case)


def _ab(benchmark, case):
    torch.manual_seed(0)
    inputs, variants = CASES[case]()
    grads = None
    times = {name: [] for name in variants}

    def one_round():
        nonlocal grads
        order = list(variants) if len(times["fastbert"]) % 2 else list(reversed(variants))
        for name in order:
            t0 = time.perf_counter()
            outs = variants[name]()
            grads = grads or [torch.randn_like(o) for o in outs]
            torch.autograd.backward(outs, grads)
            times[name].append(time.perf_counter() - t0)
            for x in inputs:
                x.grad = None

    benchmark.group = f"train-mode dropout p={P}, fp32 cpu: forward + backward, interleaved A/B"
    if not benchmark.disabled:
        one_round()  # warm-up, not counted
        times = {name: [] for name in variants}
    benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else ROUNDS)
    medians = {name: statistics.median(t) for name, t in times.items()}
    elements = sum(x.numel() for x in inputs)
    baseline = next(name for name in variants if name != "fastbert")
    benchmark.extra_info.update(
        kind="dropout-ab", case=case, p=P, dtype="fp32", device="cpu", threads=torch.get_num_threads(),
        elements=elements, rounds=len(times["fastbert"]), baseline=baseline,
        **{f"{name}_median_ms": m * 1e3 for name, m in medians.items()},
        **{f"{name}_ns_per_element": m * 1e9 / elements for name, m in medians.items()},
        ratio_fastbert_over_baseline=medians[baseline] / medians["fastbert"])
