"""LoRA fine-tuning step on CPU, interleaved A/B: fastbert + PEFT against stock transformers + PEFT (sdpa).

The step is what a LoRA fine-tune repeats: forward in train mode (dropout on), classification loss, backward, AdamW
step and zero_grad over the trainable parameters (the adapters and the new classifier). BERT-base-shaped random
weights (hidden 768, 12 layers, 12 heads, intermediate 3072), LoRA r=8 on query and value (PEFT's default BERT
targets), 16 sequences of 16..256 tokens (fixed seed) padded to the longest: HF computes every padded position,
fastbert only the real tokens. Both sides alternate round by round (see test_bench_ab.py for why); each round is one
step of each, the order flipping every round. Both are checked equal (eval logits) before timing.
"""
import copy
import statistics
import time

import pytest
import torch

from bench import harness

peft = pytest.importorskip("peft")
CELL = harness._varlen(16, 16, 256)
ROUNDS = 5  # a BERT-base training step takes 5-10 s on 2 cores; 5 interleaved rounds + 1 warm-up


def lora_classifier(config):
    import transformers
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    return model


def lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"],
                                                      task_type="SEQ_CLS"))


def test_lora_fine_tuning_step_fastbert_vs_hf_sdpa_cpu(benchmark):
    if torch.cuda.is_available():
        pytest.skip("the interleaved A/B is the CPU figure")
    with torch.inference_mode(False), torch.enable_grad():  # bench/conftest.py runs every benchmark in inference mode
        _lora_step_ab(benchmark)


def _lora_step_ab(benchmark):
    import transformers

    import fastbert
    config = harness.hf_config("bert-base")
    config.num_labels, config._attn_implementation = 2, "sdpa"
    hf = lora_classifier(config)
    variants = {"hf-sdpa+peft": lora(copy.deepcopy(hf)),
                "fastbert+peft": lora(fastbert.optimize(copy.deepcopy(hf), kernels="torch"))}
    assert isinstance(variants["fastbert+peft"].base_model.model.bert, fastbert.BertModel)
    assert isinstance(variants["hf-sdpa+peft"].base_model.model.bert, transformers.BertModel)
    with torch.no_grad():  # the same adapter weights on both sides (B is drawn: PEFT starts it at zero)
        ours = dict(variants["fastbert+peft"].named_parameters())
        for name, p in variants["hf-sdpa+peft"].named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.02)
                ours[name].copy_(p)
    cell = harness.ci_cell(CELL) if benchmark.disabled else CELL  # CI: the check and one step on a few rows
    batch = harness.make_batch(config, cell, "cpu")
    labels = torch.arange(cell.batch) % 2
    with torch.no_grad():
        logits = {name: m.eval()(**batch.inputs).logits for name, m in variants.items()}
    error = (logits["fastbert+peft"] - logits["hf-sdpa+peft"]).abs().max().item()
    assert error <= 1e-4, f"max |fastbert - HF| logits = {error:.3g}; not timing it"

    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for name, m in variants.items()}
    for m in variants.values():
        m.train()
    times = {name: [] for name in variants}

    def one_round():
        order = list(variants) if len(times["hf-sdpa+peft"]) % 2 else list(reversed(variants))
        for name in order:
            model, optimizer = variants[name], optimizers[name]
            t0 = time.perf_counter()
            model(**batch.inputs, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - t0)

    benchmark.group = f"bert-base LoRA r=8 query+value, {cell.name} fp32 cpu: fine-tuning step, interleaved A/B"
    if not benchmark.disabled:
        one_round()  # warm-up, not counted
        times = {name: [] for name in variants}
    benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else ROUNDS)
    medians = {name: statistics.median(t) for name, t in times.items()}
    benchmark.extra_info.update(
        kind="lora-step-ab", model="bert-base", cell=cell.name, dtype="fp32", device="cpu",
        rounds=len(times["hf-sdpa+peft"]), real_tokens=batch.real_tokens, padded_tokens=batch.padded_tokens,
        max_logit_error=error, threads=torch.get_num_threads(),
        **{f"{name}_median_s": m for name, m in medians.items()},
        **{f"{name}_all_s": t for name, t in times.items()},
        ratio_fastbert_over_hf_sdpa=medians["hf-sdpa+peft"] / medians["fastbert+peft"])
