"""bench/compile_keys.py's model of Triton's JIT key against the installed Triton's own binder.

The cold-start budget of the first GPU run (bench/gpu_check.py) counts compiles by that model: if it drifted from
Triton (a new specialisation rule, an argument fastbert adds), the budget would count the wrong thing. Each kernel
fastbert launches is recorded at the shapes the GPU run uses (and at awkward ones: 1 token, a prime count, an
unaligned view), the training kernels too (every train_kernel variant's forward and backward, dropout included, as
the backward smoke runs them), and its modelled key compared with Triton's, here in Triton 3.9 and, in CI's Triton
3.6 virtualenv, in the GPU image's Triton. The recording needs the compiled kernels (not the interpreter this test
session runs), so it runs in a subprocess.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import importlib, json, pkgutil, sys
import torch
from triton.runtime.jit import JITFunction
from bench import compile_keys
from bench.gpu_check import KernelChecks
import fastbert.kernels

def gemm_calls(checks):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kernel in ("tma", "ptr") if dtype != torch.float32 else ("ptr",):
            for M in (1, 13, 203, 4096):
                for act, gated, bias in ((None, False, True), ("gelu", False, True), ("gelu", True, False)):
                    if gated and dtype == torch.float32:
                        continue
                    checks.gemm(dtype, kernel, act, None, M, 96, 64, gated=gated, bias=bias)

results = []
with compile_keys.Launches("record", keep_calls=True) as launches, compile_keys.pretend_sm90(), \
        torch.inference_mode():
    checks = KernelChecks("cpu", dry_run=False, launch_only=True)
    gemm_calls(checks)
    for short in ("bf16", "fp16"):
        for _, check in checks.smoke(short):
            check()
    for lengths in ([1], [3, 17, 0, 128], [300, 512, 77]):
        for extra in ({}, {"bias": True}, {"window": 8, "rotary": True}, {"disentangled": True}):
            checks.attention(torch.float16, lengths, 2, 64, **extra)
    checks.attention(torch.float32, [5, 9], 2, 32)
    x = torch.randn(7, 3, 2, 64, dtype=torch.float16)[1:]  # an unaligned view: the pointer is not 16-byte aligned
    from fastbert.kernels import residual_layernorm as rl
    y = torch.randn(11, 48, dtype=torch.float16)
    w = torch.randn(32, 48, dtype=torch.float16)
    rl.residual_layernorm(y[1:], w, None, torch.randn(10, 32, dtype=torch.float16), torch.ones(32, dtype=torch.float16),
                          torch.zeros(32, dtype=torch.float16), 1e-5)
    # training, in the GPU run's dtype: torch's GEMMs of the backward need not compute (keys only)
    with compile_keys.SkipProducts():
        for _, check in checks.smoke_backward("bf16"):
            check()
for fn, args, kwargs in launches.calls:
    name, spec, options = compile_keys.launch_key(fn, args, kwargs)
    t_spec, t_options = compile_keys.triton_key(fn, args, kwargs)
    results.append({"kernel": name, "params": [p.name for p in fn.params], "model": [list(s) for s in spec],
                    "triton": [list(s) for s in t_spec], "model_options": [list(o) for o in options],
                    "triton_options": [list(o) for o in t_options]})
# every kernel of fastbert.kernels: a @triton.jit function that reads its program id (the others are device functions)
kernels = sorted({v.__name__ for m in pkgutil.iter_modules(fastbert.kernels.__path__)
                  for v in vars(importlib.import_module(f"fastbert.kernels.{m.name}")).values()
                  if isinstance(v, JITFunction) and "tl.program_id(" in v.src})
json.dump({"kernels": kernels, "launches": results}, sys.stdout, default=str)
'''


@pytest.fixture(scope="module")
def recording():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def launches(recording):
    return recording["launches"]


def dropout_on(record) -> bool:
    """Whether a recorded launch is a kernel's dropout form (its DROPOUT constexpr set)."""
    return dict(zip(record["params"], record["model"])).get("DROPOUT") == ["constexpr", True]


def test_every_kernel_is_recorded(recording, launches):
    """The recording reaches each kernel fastbert launches (each @triton.jit function of fastbert.kernels that
    reads its program id: a kernel, not a device function), the training kernels' backward included, and the
    dropout form of every kernel that has one, so the comparisons below cover them all."""
    assert {r["kernel"] for r in launches} == set(recording["kernels"])
    assert set(recording["kernels"]) >= {"gemm_kernel", "gemm_tma_kernel", "_attention_fwd_kernel",
                                         "bias_residual_layernorm_kernel", "_attention_bwd_dkdv_kernel",
                                         "_attention_bwd_dq_kernel", "bias_gelu_backward_kernel",
                                         "layernorm_backward_kernel"}
    with_dropout = {r["kernel"] for r in launches if dropout_on(r)}
    assert with_dropout == {r["kernel"] for r in launches if "DROPOUT" in r["params"]} == {
        "_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel",
        "bias_residual_layernorm_kernel", "layernorm_backward_kernel"}


def test_modelled_key_is_tritons_key(launches):
    """Argument by argument, the modelled specialisation is the one Triton's binder computes, and so are the
    launch options: a difference names the kernel, the argument and both values."""
    for r in launches:
        model, triton_spec = r["model"], r["triton"]
        assert len(model) == len(triton_spec), r["kernel"]
        diffs = [(i, m, t) for i, (m, t) in enumerate(zip(model, triton_spec)) if m != t]
        assert not diffs, f"{r['kernel']}: argument (index, model, triton) {diffs}"
        assert r["model_options"] == r["triton_options"], r["kernel"]


def test_token_counts_share_one_binary(launches):
    """Token counts are not specialised: the GEMMs at 1, 13, 203 and 4,096 rows (one config, one dtype, one
    epilogue) launch one key, so a cold machine compiles each GEMM config once, whatever the batch."""
    by_config: dict = {}
    for r in launches:
        if r["kernel"] in ("gemm_kernel", "gemm_tma_kernel"):
            constexprs = tuple(json.dumps(s) for s in r["model"] if s[0] == "constexpr")
            by_config.setdefault((r["kernel"], r["model"][0][0], constexprs, json.dumps(r["model_options"])),
                                 set()).add(json.dumps(r["model"]))
    assert by_config
    many = {k: len(v) for k, v in by_config.items() if len(v) > 1}
    assert not many, f"one GEMM config compiles once per token count: {many}"


ROWS_SCRIPT = r'''
import json, sys
from bench import compile_keys, gpu_check, harness
from fastbert.kernels import gemm

tiles = gemm.gemm_configs(2) + gemm.gemm_configs(4) + gemm.gemm_tma_configs(False) + gemm.gemm_tma_configs(True)
out = {"tallest_tile": max(c[0] for c in tiles)}
for job in sys.argv[1:]:
    out[job] = {"all": compile_keys.job_keys(job, rows=32),
                "few": compile_keys.job_keys(job, rows=compile_keys.RECORD_TRAIN_ROWS)}
cells = {}
for model, cell, _ in gpu_check.TRAIN:
    batch, labels = harness.train_batch(model, compile_keys.parse_cell(cell), "cpu")
    few, _ = compile_keys.fewer_rows(batch, labels, compile_keys.RECORD_TRAIN_ROWS)
    cells[f"{model}/{cell}"] = {"tokens": few.real_tokens, "width": few.real.shape[1],
                                "longest": int(few.real.sum(1).max()), "cell_longest": int(batch.real.sum(1).max())}
out["cells"] = cells
json.dump(out, sys.stdout)
'''


def test_training_jobs_are_recorded_on_fewer_rows_with_the_same_keys():
    """bench/compile_keys.py records a training job on RECORD_TRAIN_ROWS of its cell's rows (a BERT-base step in bf16
    on all 32 takes this CPU minutes). The keys agree with all 32 rows' wherever those rows hold as many tokens as the
    tallest GEMM tile (below that, M_BUCKET prunes tiles) and the cell's longest row (attention's
    seq_bucket): shown on the tiny training models at 32 x 64 (4 rows = 256 tokens), and each GPU training cell's few
    rows are checked to hold at least that many tokens and the cell's longest row."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    # (not the LoRA model: this file also runs where PEFT is not installed, and its adapters are torch's own GEMMs)
    jobs = ["train:tiny:32x64:bf16", "train:tiny-modernbert:32x64:fp16"]
    out = subprocess.run([sys.executable, "-c", ROWS_SCRIPT, *jobs], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    for job in jobs:
        assert result[job]["all"] and result[job]["all"] == result[job]["few"], job
    assert result["tallest_tile"] <= 256  # the tiny jobs' 256 tokens reach every tile
    for cell, seen in result["cells"].items():
        assert seen["tokens"] >= result["tallest_tile"], cell
        assert seen["longest"] == seen["cell_longest"] == seen["width"], cell
