"""The bench's own tools, on synthetic data: the summary printer's arithmetic and files, the GPU check's plumbing.

Cheap (no model runs), so `pytest bench/ --benchmark-disable` in CI keeps them from rotting.
"""
import json
import os
import subprocess
import sys

import pytest

from bench import gpu_check, harness, summarize


def _model_bench(model, cell, dtype, variant, median, real=1000, padded=1200, **extra):
    info = dict(kind="model", model=model, cell=cell, dtype=dtype, device="cuda", variant=variant, real_tokens=real,
                padded_tokens=padded, **extra)
    return {"group": f"{model} {cell} {dtype}", "name": f"test_model[{variant}]", "extra_info": info,
            "stats": {"median": median}}


def _op_bench(backend, median, calls=32):
    info = dict(kind="op", op="bias_gelu", shape="T4096 H768 I3072", dtype="bf16", backend=backend, bound="compute",
                flops=2 * 4096 * 768 * 3072, bytes=10**8, calls_per_round=calls,
                ceilings={"copy_GBps": 4000.0, "gemm_TFLOPs": 800.0})
    return {"group": "op", "name": backend, "extra_info": info, "stats": {"median": median}}


@pytest.fixture
def results(tmp_path):
    benchmarks = [
        _model_bench("bert-base", "32x128", "fp16", "fastbert-triton", 0.001),
        _model_bench("bert-base", "32x128", "fp16", "fastbert-torch", 0.004),
        _model_bench("bert-base", "32x128", "fp16", "hf-eager", 0.003),
        _model_bench("bert-base", "32x128", "fp16", "hf-sdpa", 0.002),
        _model_bench("bert-base", "32x128", "fp16", "hf-compile", 0.0015, compile_s=42.0),
        _model_bench("bert-base", "1x128", "fp16", "hf-sdpa", 0.002),  # no fastbert here: no ratio row
        _op_bench("triton", 32 * 50e-6),
        _op_bench("torch", 32 * 100e-6),
        {"group": "x", "name": "broken", "extra_info": {"kind": "model"}, "stats": {"median": 0}},  # ignored
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": "2026-11-29T00:00:00",
                                "machine_info": {"fastbert_bench": {"gpu": "NVIDIA H200", "torch": "2.11",
                                                                    "triton": "3.6", "transformers": "5.17"}}}))
    return path


def test_ratios_are_tokens_per_second_quotients(results):
    benchmarks, _ = summarize.load([str(results)])
    cells = summarize.model_cells(benchmarks)
    assert set(cells) == {("bert-base", "32x128", "fp16", "cuda"), ("bert-base", "1x128", "fp16", "cuda")}
    assert cells[("bert-base", "32x128", "fp16", "cuda")]["variants"]["hf-sdpa"]["tokens_per_s"] == pytest.approx(5e5)
    rows = {r["variant"]: r for r in summarize.ratios(cells)}
    assert set(rows) == {"fastbert-triton", "fastbert-torch"}
    triton = rows["fastbert-triton"]
    assert triton["hf-sdpa"] == pytest.approx(2.0)
    assert triton["hf-eager"] == pytest.approx(3.0)
    assert triton["hf-compile"] == pytest.approx(1.5)
    assert rows["fastbert-torch"]["hf-sdpa"] == pytest.approx(0.5)


def test_render_and_files(results, tmp_path):
    out = tmp_path / "out"
    assert summarize.main([str(results), str(tmp_path / "missing.json"), "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert "| bert-base | 32x128 | fp16 | cuda | fastbert-triton | 1,000,000 | 2.00× | 3.00× | 1.50× |" in text
    assert "| 42.0 |" in text  # compile time, reported apart from the rounds
    # the op: per call = median / calls_per_round = 50 us -> 2*4096*768*3072 / 50e-6 = 386.5 TFLOP/s (387), 2x the twin
    assert "| bias_gelu | T4096 H768 I3072 | bf16 | triton | 50.0 | 387 | 2000 | 48% of GEMM | 2.00× |" in text
    assert "NVIDIA H200" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "tokens_per_s.png").exists()
    else:
        assert (out / "tokens_per_s.png").read_bytes()[:4] == b"\x89PNG"


def test_encode_table():
    info = dict(kind="encode", model="minilm", dtype="fp32", device="cpu", texts=512, real_tokens=30279, rounds=5,
                fastbert_texts_per_s=30.0, **{"sentence-transformers_texts_per_s": 20.0},
                ratio_fastbert_over_sentence_transformers=1.5,
                computed_tokens={"fastbert": 47056, "sentence-transformers": 52544})
    text = summarize.render([{"group": "g", "name": "n", "extra_info": info, "stats": {"median": 40.0}}], meta=[])
    assert "| minilm | fp32 | cpu | 512 / 30279 | 5 | 30.0 | 20.0 | 1.50× | 47056 / 52544 |" in text


def test_plot_degrades_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if it were absent
    cells = {("m", "1x128", "fp16", "cuda"): {"variants": {"hf-sdpa": {"tokens_per_s": 1.0}}}}
    why = summarize.plot(cells, str(tmp_path / "p.png"))
    assert why and "matplotlib" in why and not (tmp_path / "p.png").exists()


def test_varlen_cell_is_fixed_and_within_bounds():
    cell = next(c for c in harness.CUDA_CELLS if c.min_len)
    lengths = cell.lengths()
    assert lengths == cell.lengths() and len(lengths) == 32  # same draw every run, every machine
    assert all(16 <= n <= 512 for n in lengths) and len(set(lengths)) > 10


def test_accuracy_bound():
    import torch

    assert harness.accuracy_bound(torch.float16, 0.01) == pytest.approx(0.02 + 1e-6)
    assert harness.accuracy_bound(torch.float32, 0.0) == harness.FP32_BOUND
    assert harness.max_error(harness.Outputs(torch.tensor([[float("nan")]]), None),
                             harness.Outputs(torch.zeros(1, 1), None)) == float("inf")  # NaN never passes


@pytest.mark.parametrize("model, pad", [("distilbert-base", 0), ("mpnet-base", 1), ("tiny-distilbert", 0),
                                        ("tiny-mpnet", 1)])
def test_batch_of_a_family_without_token_types(model, pad):
    """DistilBERT and MPNet get no token_type_ids (their transformers 4.x forward has no such argument), and no
    real token is the pad id (MPNet would give it the padding position); padded positions hold it."""
    config = harness.hf_config(model)
    cell = harness._varlen(32, 16, 512) if model.endswith("-base") else harness.TINY_CELLS[-1]
    batch = harness.make_batch(config, cell, "cpu")
    assert sorted(batch.inputs) == ["attention_mask", "input_ids"]
    ids = batch.inputs["input_ids"]
    assert not (ids[batch.real] == pad).any() and (ids[~batch.real] == pad).all() and (~batch.real).any()
    assert batch.real_tokens == sum(cell.lengths())
    bert = harness.make_batch(harness.hf_config("tiny"), cell, "cpu")
    assert sorted(bert.inputs) == ["attention_mask", "input_ids", "token_type_ids"]


def test_base_family_configs_have_the_published_shapes():
    distil = harness.hf_config("distilbert-base")  # distilbert-base-uncased
    assert (type(distil).__name__, distil.dim, distil.n_layers, distil.n_heads, distil.hidden_dim,
            distil.max_position_embeddings, distil.pad_token_id) == ("DistilBertConfig", 768, 6, 12, 3072, 512, 0)
    mpnet = harness.hf_config("mpnet-base")  # all-mpnet-base-v2
    assert (type(mpnet).__name__, mpnet.hidden_size, mpnet.num_hidden_layers, mpnet.num_attention_heads,
            mpnet.intermediate_size, mpnet.max_position_embeddings, mpnet.relative_attention_num_buckets,
            mpnet.pad_token_id) == ("MPNetConfig", 768, 12, 12, 3072, 514, 32, 1)
    assert harness.hf_variant("mpnet-base") == "hf-eager" and harness.hf_variant("distilbert-base") == "hf-sdpa"
    modern = harness.hf_config("modernbert-base")  # answerdotai/ModernBERT-base
    assert (type(modern).__name__, modern.hidden_size, modern.num_hidden_layers, modern.num_attention_heads,
            modern.intermediate_size, modern.max_position_embeddings, modern.local_attention,
            modern.layer_types[:4]) == ("ModernBertConfig", 768, 22, 12, 1152, 8192, 128,
                                        ["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    assert harness.hf_variant("modernbert-base") == "hf-sdpa"
    assert harness.reference_attention("modernbert-base") == "sdpa"


def test_decoder_embedder_configs_have_the_real_layer_geometry():
    """Qwen3-Embedding-0.6B's and EmbeddingGemma-300m's layers as their Hub configs give them, fewer of them."""
    qwen = harness.hf_config("qwen3-embedding-0.6b")
    assert (type(qwen).__name__, qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim,
            qwen.intermediate_size, qwen.rope_parameters["rope_theta"], qwen.vocab_size, qwen.num_hidden_layers) == \
        ("Qwen3Config", 1024, 16, 8, 128, 3072, 1000000.0, 151669, 2)
    gemma = harness.hf_config("embeddinggemma-300m")
    assert (type(gemma).__name__, gemma.hidden_size, gemma.num_attention_heads, gemma.num_key_value_heads,
            gemma.head_dim, gemma.intermediate_size, gemma.query_pre_attn_scalar, gemma.use_bidirectional_attention,
            gemma.vocab_size) == ("Gemma3TextConfig", 768, 3, 1, 256, 1152, 256, True, 262144)
    assert gemma.layer_types == ["sliding_attention"] * 5 + ["full_attention"]  # the 300m's pattern, once
    assert harness.hf_variant("qwen3-embedding-0.6b") == harness.hf_variant("embeddinggemma-300m") == "hf-sdpa"


def test_flop_ceiling_counts_by_hand():
    """flop_ceiling on lengths small enough to count: linear 2 (H q + 2 H kv + q H + 3 H I) a token for a gated MLP
    (2 H I for a plain one), 4 q a pair; HF pads to the longest and computes every pair; causal reads j <= i, a
    window |i - j| <= w."""
    import types

    base = dict(hidden_size=4, intermediate_size=8, num_attention_heads=2, head_dim=2, num_key_value_heads=1,
                layer_types=["full_attention"], num_hidden_layers=1, sliding_window=1)
    linear = 2 * (4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8)  # q = 4, kv = 2: 320 a token
    both = types.SimpleNamespace(**base, model_type="gte")
    got = harness.flop_ceiling(both, [2, 3])
    assert got["hf_flops"] == 2 * 3 * linear + 4 * 4 * 2 * 9
    assert got["padding_free_flops"] == got["useful_flops"] == 5 * linear + 4 * 4 * (4 + 9)
    causal = harness.flop_ceiling(types.SimpleNamespace(**base, model_type="qwen3"), [2, 3])
    assert causal["useful_flops"] == 5 * linear + 4 * 4 * (3 + 6)  # 1 + 2 and 1 + 2 + 3 pairs
    window = harness.flop_ceiling(types.SimpleNamespace(**{**base, "layer_types": ["sliding_attention"]},
                                                        model_type="gemma3_text", use_bidirectional_attention=True),
                                  [2, 3])
    assert window["useful_flops"] == 5 * linear + 4 * 4 * (4 + 7)  # L = 3, w = 1: 2 + 3 + 2 pairs
    plain = harness.flop_ceiling(types.SimpleNamespace(**base, model_type="bert"), [2, 3])
    assert plain["padding_free_flops"] == 5 * (linear - 2 * 4 * 8) + 4 * 4 * (4 + 9)
    # DistilBERT names the sizes its own way (dim, n_heads, hidden_dim): a plain MLP of H 768 and I 3072
    distil = harness.flop_ceiling(harness.hf_config("distilbert-base"), [1])
    assert distil["padding_free_flops"] == 6 * (2 * (4 * 768 * 768 + 2 * 768 * 3072) + 4 * 768)
    # GTE's cell in bench/RESULTS.md: 1.83x
    assert harness.flop_ceiling(harness.hf_config("gte-base"), harness._varlen(16, 64, 2048).lengths())[
        "ceiling_padding"] == pytest.approx(1.83, abs=0.005)


@pytest.mark.parametrize("model, hf_class", [("tiny-distilbert", "DistilBertModel"), ("tiny-mpnet", "MPNetModel"),
                                             ("tiny-modernbert", "ModernBertModel"), ("tiny-nomic", "NomicBertModel")])
def test_bank_builds_families_with_transformers_classes(bank, model, hf_class):
    """HF's own class for the master and every HF variant; MPNet's missing sdpa is a skip reason naming the class,
    never a silent eager; fastbert built from HF's best variant matches HF eager fp32 on the tiny ragged cell."""
    import torch

    cell = harness.TINY_CELLS[-1]
    assert type(bank.master(model)).__name__ == hf_class
    best = harness.hf_attention(model)[-1]
    hf = bank.hf(model, best, torch.float32, "cpu")
    assert type(hf).__name__ == hf_class and hf.config._attn_implementation == best
    if model == "tiny-mpnet":
        with pytest.raises(harness.Unavailable, match="MPNetModel has no 'sdpa' attention"):
            bank.hf(model, "sdpa", torch.float32, "cpu")
    batch = bank.batch(model, cell, "cpu")
    out = bank.fastbert(model, torch.float32, "cpu")(**batch.inputs)
    assert harness.max_error(harness.Outputs.of(out, batch), bank.reference(model, cell, "cpu")) <= 1e-5


@pytest.mark.parametrize("model", ["tiny-nomic", "nomic-embed-base", "gte-base", "eurobert-210m"])
def test_a_family_newer_than_transformers_is_a_skip_that_says_so(monkeypatch, model):
    """Where transformers predates a family (the GPU image's 5.17 and NomicBERT), its cells skip naming the missing
    class: the rest of the run goes on."""
    import transformers

    name = {"tiny-nomic": "NomicBertConfig", "nomic-embed-base": "NomicBertConfig", "gte-base": "GteConfig",
            "eurobert-210m": "EuroBertConfig"}[model]
    assert type(harness.hf_config(model)).__name__ == name
    monkeypatch.setattr(transformers, name, None)  # what getattr(transformers, name, None) gives where it is absent
    with pytest.raises(harness.Unavailable, match=f"transformers .* has no {name}"):
        harness.hf_config(model)


PLAN_ORDER = ["env", "smoke-bf16",
              "headline/32x128/hf-sdpa", "headline/32x128/fastbert-triton", "headline/32x128/fastbert-graphs",
              "headline/32xvar16-512/hf-sdpa", "headline/32xvar16-512/fastbert-triton",
              "headline/32xvar16-512/fastbert-graphs",
              "headline/1x128/hf-sdpa", "headline/1x128/fastbert-graphs", "headline/1x128/fastbert-triton",
              "smoke-fp16",
              "headline/distilbert-base/32xvar16-512/hf-sdpa",
              "headline/distilbert-base/32xvar16-512/fastbert-triton",
              "headline/distilbert-base/32xvar16-512/fastbert-graphs",
              "headline/mpnet-base/32xvar16-512/hf-eager", "headline/mpnet-base/32xvar16-512/fastbert-triton",
              "headline/mpnet-base/32xvar16-512/fastbert-graphs",
              "headline/modernbert-base/32xvar16-512/hf-sdpa",
              "headline/modernbert-base/32xvar16-512/fastbert-triton",
              "headline/modernbert-base/32xvar16-512/fastbert-graphs",
              "headline/nomic-embed-base/32xvar16-512/hf-sdpa",
              "headline/nomic-embed-base/32xvar16-512/fastbert-triton",
              "headline/nomic-embed-base/32xvar16-512/fastbert-graphs",
              "headline/modernbert-base/8x8192/hf-sdpa", "headline/modernbert-base/8x8192/fastbert-triton",
              "smoke-backward-bf16",
              "train/bert-base/32xvar16-512/hf-sdpa", "train/bert-base/32xvar16-512/fastbert-triton",
              "train/bert-base-lora/32xvar16-512/hf-sdpa", "train/bert-base-lora/32xvar16-512/fastbert-triton",
              "train/bert-base/32x128/hf-sdpa", "train/bert-base/32x128/fastbert-triton",
              "train/modernbert-base/32xvar16-512/hf-sdpa", "train/modernbert-base/32xvar16-512/fastbert-triton",
              "invariance-bf16", "serve/bert-base/64-clients",
              "smoke-forward", *(f"configs-{f}" for f in gpu_check.CONFIG_FAMILIES), "headline/32x128/hf-compile",
              "ops", "choices", "memcheck", "tests-bf16", "tests-kernels", "tests-model", "tests-train"]


@pytest.mark.parametrize("dry_run", [False, True], ids=["gpu", "dry-run"])
def test_gpu_check_plan_order(dry_run):
    """The headline first: env, the bf16 smoke of every kernel variant, then BERT's cells with fastbert right after
    its HF baseline, the fp16 smoke, the other families, then training (the backward smoke, the training cells),
    serving (batch invariance, the served load), the forward smoke, the config sweeps; hf-compile (Inductor's cold
    start on the GPU image is unproven) only after every headline case. One pytest process per case; the dry run
    has the same steps in the same order."""
    steps = gpu_check.plan(dry_run)
    names = [s.name for s in steps]
    assert names == [s.name for s in gpu_check.plan(not dry_run)]
    assert names == PLAN_ORDER
    assert {s.group for s in steps if s.name.startswith("configs-")} == {"configs"}
    cases = [s for s in steps if s.stage == "2"]
    assert max(names.index(s.name) for s in cases if s.info["variant"] != "hf-compile") < names.index(
        "headline/32x128/hf-compile")
    for step in cases:  # every fastbert case comes after its cell's HF baseline
        if step.info["variant"].startswith("fastbert-"):
            hf = [s for s in cases if s.info["cell"] == step.info["cell"] and s.info["model"] == step.info["model"]
                  and s.info.get("kind") == step.info.get("kind") and s.info["variant"].startswith("hf-")][0]
            assert names.index(hf.name) < names.index(step.name)
    # training after every inference headline and family case, the backward smoke right before it
    train = [names.index(s.name) for s in cases if s.info.get("kind") == "train"]
    inference = [names.index(s.name) for s in cases if s.info.get("kind") != "train"
                 and s.info["variant"] != "hf-compile"]
    assert len(train) == 8 and max(inference) < names.index("smoke-backward-bf16") < min(train)
    assert [s.info["variant"] for s in cases if s.info.get("kind") == "train"] == ["hf-sdpa", "fastbert-triton"] * 4
    cells = {c.name for c in (harness.TINY_CELLS if dry_run else harness.CUDA_CELLS
                              + sum(harness.MODEL_CUDA_CELLS.values(), ()))}
    for step in cases:
        args = step.cmd
        assert os.path.exists(os.path.join(gpu_check.REPO, args[args.index("pytest") + 1]))
        variants = args[args.index("--bench-variants") + 1].split(",")
        assert variants == [step.info["variant"]], "one case per process"
        assert args[args.index("--bench-cells") + 1] == step.info["runs_as"] and step.info["runs_as"] in cells
        assert ("--bench-compile" in args) == (step.info["variant"] == "hf-compile")
        assert any(a.endswith(step.bench_json) for a in args if a.startswith("--benchmark-json="))
        model = step.info["model"]
        tiny = gpu_check.TINY_TRAIN_MODEL if step.info.get("kind") == "train" else gpu_check.TINY_MODEL
        assert args[args.index("--bench-models") + 1] == (tiny[model] if dry_run else model)
        assert ("--bench-tiny" in args) == dry_run
    assert len({s.bench_json for s in cases}) == len(cases)  # each case its own JSON


def test_gpu_check_runs_the_training_tests():
    """The tests-train step runs the model-level training tests on the GPU's compiled kernels (every family's
    gradients against the twins', dropout in the kernels, Trainer / PEFT / sentence-transformers steps): its command
    names both files, and the dry run's form of it collects their tests."""
    step = next(s for s in gpu_check.plan(False) if s.name == "tests-train")
    assert set(gpu_check.TRAIN_TESTS) == {"tests/model/test_train_kernels.py",
                                          "tests/integration/test_fine_tuning_on_kernels.py"}
    assert set(gpu_check.TRAIN_TESTS) <= set(step.cmd) and "--collect-only" not in step.cmd
    dry = next(s for s in gpu_check.plan(True) if s.name == "tests-train")
    collected = subprocess.run(dry.cmd, cwd=gpu_check.REPO, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    for test in ("test_gradients_on_the_kernels_equal_the_twins", "test_dropout_on_the_kernels_is_reproducible",
                 "test_trainer_step_on_the_kernels_is_the_twins_step",
                 "test_a_dropout_step_on_the_kernels_is_reproducible"):
        assert test in collected.stdout, test


def test_gpu_check_caps_follow_the_compile_estimate():
    """A step's cap is its run time plus COMPILE_S for each JIT key it is the first to need, in run order: keys an
    earlier step compiled cost nothing again, and the steps of a group count from before the group."""
    estimate = {"smoke:bf16": ["a", "b", "c"], "forward:bert-base:32x128:bf16": ["b", "d"]}
    estimate.update({job: ["a"] for step in gpu_check.plan(False, with_estimate=False) for job in step.jobs
                     if job not in estimate})
    steps = {s.name: s for s in gpu_check.plan(False, estimate=estimate)}
    assert steps["smoke-bf16"].compiles == ["a", "b", "c"]
    assert steps["smoke-bf16"].cap == gpu_check.RUN_S["smoke"] + 3 * gpu_check.COMPILE_S
    assert steps["headline/32x128/fastbert-triton"].compiles == ["d"]
    assert steps["headline/32x128/fastbert-graphs"].compiles == []
    assert steps["headline/32x128/fastbert-graphs"].cap == gpu_check.RUN_S["fastbert-graphs"]
    assert steps["headline/32x128/hf-sdpa"].cap == gpu_check.RUN_S["hf-sdpa"]
    stale = {s.name: s for s in gpu_check.plan(False, estimate={"smoke:bf16": []})}  # a job the estimate lacks
    assert len(stale["headline/32x128/fastbert-triton"].compiles) == gpu_check.UNKNOWN_COMPILES


def test_gpu_check_jobs_come_in_the_order_the_steps_need_them():
    """The background compiles what the headline needs first; every job is one bench/compile_keys.py can run (the
    estimate naming each of them, recorded with the kernels as they are: test_compile_estimate_is_current)."""
    jobs = gpu_check.background_jobs(gpu_check.plan(False, with_estimate=False))
    assert jobs[:2] == ["smoke:bf16", "forward:bert-base:32x128:bf16"]  # what the headline needs first
    assert {job.split(":")[0] for job in jobs} == {"smoke", "forward", "smoke-backward", "train", "invariant",
                                                   "configs"}
    train = [job for job in jobs if job.startswith(("smoke-backward:", "train:"))]
    assert train == ["smoke-backward:bf16", "train:bert-base:32xvar16-512:bf16",
                     "train:bert-base-lora:32xvar16-512:bf16", "train:bert-base:32x128:bf16",
                     "train:modernbert-base:32xvar16-512:bf16"]
    estimate = gpu_check.load_estimate()
    assert all(estimate[job] for job in jobs if job in estimate)


# Every kernel variant (the smoke) and every backward (its smoke), BERT's autotuned forward, and the two families
# whose launches differ most
CURRENT_JOBS = ("smoke:bf16", "smoke-backward:bf16", "forward:bert-base:32x128:bf16",
                "forward:mpnet-base:32xvar16-512:bf16", "forward:modernbert-base:32xvar16-512:bf16")


@pytest.mark.slow
def test_compile_estimate_is_current(tmp_path):
    """bench/compile_keys.json names every job of the plan, and re-recording the keys of the jobs that cover every
    kernel variant gives its keys: a kernel change that alters what a cold GPU compiles (a new constexpr, a
    specialised argument), or a new job, must come with the new estimate (`python -m bench.compile_keys
    --estimate`)."""
    import subprocess
    import sys

    jobs = gpu_check.background_jobs(gpu_check.plan(False, with_estimate=False))

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels' launch path
    out = subprocess.run([sys.executable, "-m", "bench.compile_keys", str(tmp_path / "now.json"), *CURRENT_JOBS],
                         cwd=gpu_check.REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    now = json.loads((tmp_path / "now.json").read_text())
    stored = gpu_check.load_estimate()
    stale = {job: (len(stored.get(job, [])), len(keys)) for job, keys in now.items() if stored.get(job) != keys}
    missing = sorted(set(jobs) - set(stored))
    assert not stale and not missing, (f"bench/compile_keys.json is stale (job: stored keys, keys now): {stale}; "
                                       f"it has no keys for the plan's jobs {missing}")


def test_smoke_covers_every_kernel_variant():
    """One check per kernel variant and dtype, named for it: the TMA and pointer GEMMs with each epilogue (none,
    GELU, tanh GELU, ReLU, GeGLU, SwiGLU), attention plain, with MPNet's bias table, ModernBERT's window + rotary,
    DeBERTa's disentangled terms and EuroBERT's grouped k/v heads with rotary, and the row kernels (post-norm,
    without the dense bias, pre-norm, and pre-norm with RMSNorm)."""
    variants = ["residual_layernorm-postnorm", "residual_layernorm-nobias", "residual_layernorm-prenorm",
                "residual_layernorm-prenorm-rms",
                *(f"gemm-{k}-{e}" for k in ("tma", "ptr") for e in ("bias", "gelu", "gelu_tanh", "relu", "gelu-gated",
                                                                   "silu-gated")),
                "attention-varlen", "attention-bias", "attention-window-rotary", "attention-disentangled",
                "attention-gqa-rotary"]
    checks = gpu_check.KernelChecks("cpu", dry_run=True)
    for short in ("bf16", "fp16"):
        assert [name for name, _ in checks.smoke(short)] == [f"{v}-{short}" for v in variants]


BACKWARD_VARIANTS = ["bias_gelu-gelu", "bias_gelu-gelu_tanh", "bias_gelu-relu", "bias_gelu-geglu", "bias_gelu-swiglu",
                     "residual_layernorm-postnorm", "residual_layernorm-prenorm", "residual_layernorm-prenorm-rms",
                     "residual_layernorm-dropout",
                     *(f"attention-{v}" for v in ("varlen", "padded", "gqa", "window-rotary", "bias", "disentangled",
                                                  "dropout"))]


def test_smoke_backward_covers_every_train_kernel_variant():
    """One check per train_kernel variant, named for it: bias_gelu's activations and gated forms, residual_layernorm
    post-norm, pre-norm, RMS pre-norm and with dropout, attention plain, padded, grouped, window + rotary, MPNet's
    bias, DeBERTa's terms and dropout. Under the interpreter (no bf16 tl.dot) the bf16 list runs in fp16."""
    checks = gpu_check.KernelChecks("cpu", dry_run=True)
    assert checks.interpret  # bench/conftest.py turns the interpreter on without CUDA
    for short in ("bf16", "fp16"):
        assert [name for name, _ in checks.smoke_backward(short)] == [f"{v}-fp16" for v in BACKWARD_VARIANTS]


def test_smoke_backward_keeps_each_check_and_says_what_is_not_built(tmp_path, monkeypatch):
    """The backward smoke records each check as it comes: an abort at one check keeps every one before it. Each
    check passes, or is a skip saying "not built" for a variant NOT_BUILT declares (none today)."""
    out = tmp_path / "out"
    monkeypatch.setenv(gpu_check.FAULT_ENV, "smoke-backward-bf16:attention-window-rotary-fp16=crash")
    assert gpu_check.main([str(out), "--dry-run", "--only", "smoke-backward-bf16"]) == 1
    records = _records(out)
    checks = [r for r in records if "check" in r]
    assert [r["check"] for r in checks] == [f"{v}-fp16" for v in BACKWARD_VARIANTS[:12]]
    for r in checks:
        declared = r["check"].removesuffix("-fp16") in gpu_check.NOT_BUILT
        assert r["status"] == "ok" or declared and r["status"] == "skipped" and r["why"].startswith("not built"), r
        if r["status"] == "ok":
            assert all(t["err"] <= t["bound"] and t["finite"] for t in r["tensors"].values()), r
    assert records[-1]["step"] == "smoke-backward-bf16" and records[-1]["status"] == "crashed"


def test_not_built_is_only_for_declared_variants():
    """NOT_BUILT names backward smoke variants (check names without their dtype)."""
    assert set(gpu_check.NOT_BUILT) <= set(BACKWARD_VARIANTS)


def _refusing(monkeypatch, unit, name):
    """`unit`'s `name` replaced by one that refuses every call, as a train_kernel refuses a variant it lacks."""
    def refuse(*args, **kwargs):
        raise ValueError(f"{unit.OP}: train_kernel cannot serve this call: a regression")
    monkeypatch.setattr(unit, name, refuse)


@pytest.mark.parametrize("variant", ["attention-varlen", "attention-dropout", "residual_layernorm-dropout",
                                     "residual_layernorm-postnorm"])
@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_a_refused_backward_variant_fails_unless_declared_not_built(monkeypatch, variant, declared):
    """A train_kernel that refuses a variant (a ValueError, or attention's train_unsupported giving a reason) fails
    that backward smoke check; only a variant NOT_BUILT lists is a skip saying "not built"."""
    import torch

    from fastbert.units import attention, residual_layernorm

    if declared:
        monkeypatch.setattr(gpu_check, "NOT_BUILT", (variant,))
    checks = gpu_check.KernelChecks("cpu", dry_run=True)
    if variant.startswith("attention-"):
        if variant == "attention-dropout":
            monkeypatch.setattr(attention, "train_unsupported", lambda *args: "dropout is not drawn here")
        else:
            _refusing(monkeypatch, attention, "train_kernel")
        check = checks.autograd(lambda: checks.attention_backward(torch.float16, [1, 7, 16], 2, 16,
                                                                  variant.removeprefix("attention-")))
    else:
        _refusing(monkeypatch, residual_layernorm, "train_kernel")
        p = 0.1 if variant.endswith("dropout") else 0.0
        check = checks.autograd(lambda: checks.residual_layernorm_backward(torch.float16, 13, 48, 32, pre_norm=p > 0,
                                                                           dropout_p=p))
    if declared:
        with pytest.raises(gpu_check.Skipped, match="^not built: "):
            check()
    else:
        with pytest.raises(RuntimeError, match=f"^{variant}: the kernels refused a variant NOT_BUILT does not list"):
            check()


def test_backward_check_fails_a_wrong_gradient(monkeypatch):
    """The backward check is not vacuous: a train_kernel whose input gradient is off by a tenth fails it."""
    import torch

    from fastbert.units import bias_gelu

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight, bias)
            return bias_gelu.twin(x, weight, bias, "gelu")

        @staticmethod
        def backward(ctx, dout):
            x, weight, bias = ctx.saved_tensors
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
                grads = torch.autograd.grad(bias_gelu.twin(*leaves, "gelu"), leaves, dout)
            return grads[0] * 1.1, grads[1], grads[2]

    monkeypatch.setattr(bias_gelu, "train_kernel", lambda x, weight, bias, activation, gated: Wrong.apply(x, weight,
                                                                                                          bias))
    checks = gpu_check.KernelChecks("cpu", dry_run=True)
    result = checks.autograd(checks.bias_gelu_backward)(torch.float16, 13, 32, 48, "gelu")
    assert not result["ok"] and result["tensors"]["dx"]["err"] > result["tensors"]["dx"]["bound"]
    assert result["tensors"]["dweight"]["err"] <= result["tensors"]["dweight"]["bound"]


def test_cpu_twin_trains_a_score_bias_in_fp32():
    """Why the dry run's trained-score-term checks take HF's eager attention as their 16-bit baseline: with a bias
    table that requires grad, the CPU twin's fp16 gradient is bit for bit its fp32 gradient rounded once (sdpa's math
    fallback upcasts), while with the table frozen (sdpa's fused CPU kernel) it rounds inside and differs."""
    import torch

    from fastbert.layout import TokenLayout
    from fastbert.units import attention

    L, nh, hd = 20, 2, 16
    g = torch.Generator().manual_seed(0)
    qkv, table = torch.randn(L, 3, nh, hd, generator=g).half(), torch.randn(nh, 2 * L - 1, generator=g)
    up = torch.randn(L, nh * hd, generator=g).half()
    layout = TokenLayout.from_cu_seqlens(torch.tensor([0, L], dtype=torch.int32), L, [L])

    def dqkv(dtype, bias, trained):
        with torch.inference_mode(False), torch.enable_grad():  # whatever mode the session runs the tests in
            x, b = qkv.to(dtype).clone().requires_grad_(), bias.clone().requires_grad_(trained)
            out = attention.twin(x, layout, hd ** -0.5, 0.0, False, attention.Extras(b, None, None, None, None))[0]
            return torch.autograd.grad(out, x, up.to(dtype).clone())[0]

    fp32_rounded = dqkv(torch.float32, table.half().float(), True).half()  # the twin casts the table to fp16
    assert torch.equal(dqkv(torch.float16, table, True), fp32_rounded)
    assert not torch.equal(dqkv(torch.float16, table, False), fp32_rounded)
    assert set(gpu_check.TRAINED_SCORE_TERMS) == {"bias", "disentangled"} <= set(BACKWARD_VARIANTS_ATTENTION)


BACKWARD_VARIANTS_ATTENTION = [v.removeprefix("attention-") for v in BACKWARD_VARIANTS if v.startswith("attention-")]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", ["bias", "disentangled"])
def test_trained_score_term_backward_checks_hold_on_other_draws(variant, seed):
    """MPNet's bias and DeBERTa's terms on the kernels within 2x HF's eager fp16 error, per tensor, on three draws
    of the inputs (draw 0 is the dry run's own); the record says which baseline it measured."""
    import torch

    checks = gpu_check.KernelChecks("cpu", dry_run=True, seed=seed)
    result = checks.autograd(lambda: checks.attention_backward(torch.float16, [1, 7, 20], 2, 16, variant))()
    assert result["baseline"] == "eager"
    assert result["ok"], result["tensors"]
    assert all(t["finite"] and 0 < t["err"] <= t["bound"] for t in result["tensors"].values()), result["tensors"]


def test_trained_score_term_backward_check_fails_a_wrong_gradient(monkeypatch):
    """The eager baseline is no free pass: a train_kernel whose qkv and bias-table gradients are 1% off fails the
    bias check on both, while the same kernel unchanged passes it."""
    import torch

    from fastbert.units import attention

    right = attention.train_kernel

    def wrong(qkv, attn, scale, dropout_p, return_probs, extras):
        for leaf in (qkv, extras.bias):
            leaf.register_hook(lambda grad: grad * 1.01)
        return right(qkv, attn, scale, dropout_p, return_probs, extras)

    checks = gpu_check.KernelChecks("cpu", dry_run=True)
    run = checks.autograd(lambda: checks.attention_backward(torch.float16, [1, 7, 20], 2, 16, "bias"))
    assert run()["ok"]
    monkeypatch.setattr(attention, "train_kernel", wrong)
    tensors = run()["tensors"]
    assert tensors["dqkv"]["err"] > tensors["dqkv"]["bound"] and tensors["dbias"]["err"] > tensors["dbias"]["bound"]
    assert tensors["out"]["err"] <= tensors["out"]["bound"]


def test_summary_names_the_tensor_a_backward_check_failed_on():
    """A failed backward check's line in summary.md gives each tensor over its bound with its figures, not None."""
    tensors = {"out": {"err": 7.5e-4, "twin_err": 7.7e-4, "bound": 1.5e-3, "finite": True},
               "dqkv": {"err": 1.36e-3, "twin_err": 5.96e-4, "bound": 1.19e-3, "finite": True}}
    records = [{"stage": "1", "step": "smoke-backward-bf16", "check": "attention-bias-fp16", "status": "failed",
                "tensors": tensors, "baseline": "eager"}]
    failed = [line for line in gpu_check.check_summary(records).splitlines() if "FAILED" in line]
    assert failed == ["  - FAILED smoke-backward-bf16 attention-bias-fp16: dqkv err 0.00136 > bound 0.00119 "
                      "(the eager's 0.000596; finite: True)"]


def test_ci_runs_the_dry_runs_kernel_checks_and_fails_on_a_failed_one(tmp_path, monkeypatch):
    """.ci/run's dry-run stage names steps that exist (every kernel-check step of the plan, nothing else), asks for
    all of them to run, and the script's exit status is what that stage reads: 1 for a crashed check and, with
    --require-all, for a step left out for lack of time; an --only that names no step is an error, never a run that
    checks nothing."""
    import re

    with open(os.path.join(gpu_check.REPO, ".ci", "run")) as f:
        script = f.read()
    steps = re.search(r"^GPU_CHECK_STEPS=(\S+)$", script, re.M).group(1)
    assert '--only "$GPU_CHECK_STEPS" --require-all' in script and '"$rcdry" -ne 0' in script
    chosen = [s.name for s in gpu_check.select(gpu_check.plan(True), steps)]
    assert chosen == [s.name for s in gpu_check.plan(True) if s.name.startswith(("smoke-", "configs-"))]
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path / "none"), "--dry-run", "--only", "smoke-bf16,no-such-step"])
    # a step the deadline leaves out: a skip for the GPU run, a failure where every step must run
    no_time = [str(tmp_path / "late"), "--dry-run", "--only", "smoke-bf16", "--budget-s", "1"]
    assert gpu_check.main(no_time) == 0 and gpu_check.main(no_time + ["--require-all"]) == 1
    assert _records(tmp_path / "late")[-1] == {"stage": "1", "step": "smoke-bf16", "status": "skipped",
                                               "why": "0 s left of the budget", "over_budget": True}
    monkeypatch.setenv(gpu_check.FAULT_ENV, "smoke-bf16:residual_layernorm-postnorm-bf16=crash")
    assert gpu_check.main([str(tmp_path / "out"), "--dry-run", "--only", "smoke-bf16", "--require-all"]) == 1


def test_train_goals_read_each_cell():
    """The training cells' line: both medians, the speed-up against the cell's goal, and the reason of a case that
    has no figure."""
    def step(model, cell, variant, **extra):
        return {"stage": "2", "step": f"train/{model}/{cell}/{variant}", "kind": "train", "model": model,
                "cell": cell, "variant": variant, **extra}

    records = [step("bert-base", "32xvar16-512", "hf-sdpa", status="ok", median_s=0.1, tokens_per_s=80000),
               step("bert-base", "32xvar16-512", "fastbert-triton", status="ok", median_s=0.04, tokens_per_s=200000,
                    triton_ops=["attention", "bias_gelu"]),
               step("bert-base", "32x128", "hf-sdpa", status="ok", median_s=0.05, tokens_per_s=80000),
               step("bert-base", "32x128", "fastbert-triton", status="ok", median_s=0.04, tokens_per_s=100000),
               step("modernbert-base", "32xvar16-512", "hf-sdpa", status="ok", median_s=0.1, tokens_per_s=1),
               step("modernbert-base", "32xvar16-512", "fastbert-triton", status="skipped", skip_reason="no kernels")]
    lines = gpu_check.train_goals(records)
    assert lines[0].endswith("2.50x HF sdpa (goal >= 2.0x: met)") and "kernels: attention, bias_gelu" in lines[0]
    assert lines[1].endswith("1.25x HF sdpa (goal >= 1.3x: not met)")
    assert "fastbert-triton skipped (no kernels)" in lines[2] and lines[2].endswith("no ratio (goal >= 2.0x)")


def test_saved_bytes_counts_distinct_storages_without_parameters():
    """The pack hook's sum: a Linear saves its input, not its weight (a parameter); two views of one storage count
    once."""
    import torch

    from bench import saved_bytes

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.linear(x[:, :8]) * self.linear(x[:, 8:])  # two views of x; the products save both outputs

    with torch.inference_mode(False):  # bench/conftest.py runs each test in inference mode
        got = saved_bytes.saved_bytes(Twice(), {"x": torch.randn(5, 16, requires_grad=True)})
        assert got == 5 * 16 * 4 + 2 * 5 * 4 * 4  # x once (both views), the two [5, 4] outputs
        # what a forward saved is freed with it, an output saved by its own op (tanh) too: no measurement is left
        # in memory (a 32 x 512 run measures 27 forwards)
        import weakref

        class Tanh(torch.nn.Module):
            def forward(self, x):
                y = x.tanh()
                self.output = weakref.ref(y)
                return y

        model = Tanh()
        assert saved_bytes.saved_bytes(model, {"x": torch.randn(64, requires_grad=True)}) == 64 * 4
        assert model.output() is None


def test_saved_bytes_runs_tiny(tmp_path):
    """`python -m bench.saved_bytes --tiny` end to end at small sizes: every variant with and without dropout, one
    layer's bytes linear in the tokens for HF, the kernel path's row saying which ops ran their kernels (and why
    not, where the dispatch refuses kernels="triton" under autograd), the JSON written."""
    out = tmp_path / "saved.json"
    code = ("import sys; from bench import saved_bytes; sys.exit(saved_bytes.main(['--tiny', '--batch', '3', "
            f"'--seq', '16', '--kernel-batches', '1,2', '--json', {str(out)!r}]))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], cwd=gpu_check.REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["dropout"], r["variant"]): r for r in result["table"]}
    assert set(rows) == {(d, v) for d in (0.1, 0.0) for v in ("hf-sdpa", "fastbert-torch", "fastbert-triton")}
    for (dropout, variant), row in rows.items():
        assert row["bytes_per_layer"] > 0 and row["bytes_per_token"] > 0
        if variant == "hf-sdpa":
            assert row["vs_hf_sdpa"] == 1.0 and abs(row["line_misses_by"]) < 1e-9 and row["kernel_ops"] is None
        if variant == "fastbert-torch":
            assert row["kernel_ops"] == [] and row["how"] == "measured"
        if variant == "fastbert-triton":
            assert isinstance(row["kernel_ops"], list) and row["how"].startswith("the line through")
            assert row["kernel_ops"] or row["triton_refused"]  # the figure says what it measured
    assert rows[(0.1, "hf-sdpa")]["bytes_per_layer"] > rows[(0.0, "hf-sdpa")]["bytes_per_layer"]  # dropout masks
    assert "| 0.0 | fastbert-triton |" in run.stdout


def test_ab_table_names_each_runs_hf_variant():
    """An A/B run against HF eager (MPNet has no sdpa) gets its row, with the variant named; a run recorded before
    the baseline was named reads as hf-sdpa."""
    mpnet = dict(kind="ab", model="mpnet-base", cell="32xvar16-512", dtype="fp32", device="cpu", rounds=3,
                 baseline="hf-eager", **{"fastbert-torch_tokens_per_s": 300.0, "hf-eager_tokens_per_s": 100.0},
                 ratio_fastbert_over_hf_eager=3.0)
    minilm = dict(kind="ab", model="minilm", cell="32x128", dtype="fp32", device="cpu", rounds=15,
                  **{"fastbert-torch_tokens_per_s": 6520.0, "hf-sdpa_tokens_per_s": 6736.0},
                  ratio_fastbert_over_hf_sdpa=0.97)
    text = summarize.ab_table([{"extra_info": mpnet}, {"extra_info": minilm}])
    assert "| mpnet-base | 32xvar16-512 | fp32 | cpu | 3 | 300 | hf-eager | 100 | 3.00× |" in text
    assert "| minilm | 32x128 | fp32 | cpu | 15 | 6520 | hf-sdpa | 6736 | 0.97× |" in text


def _records(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_gpu_check_keeps_each_case_when_later_ones_crash_or_hang(tmp_path, monkeypatch, capsys):
    """A case that aborts (a CUDA abort's SIGABRT) and one that hangs past its timeout cost only themselves: the
    records of the steps before them are on disk, and the cases after them still run."""
    out = tmp_path / "out"
    monkeypatch.setenv(gpu_check.FAULT_ENV, "headline/32x128/hf-sdpa=crash,headline/32xvar16-512/hf-sdpa=hang")
    only = "env,headline/32x128/hf-sdpa,headline/32xvar16-512/hf-sdpa,headline/1x128/hf-sdpa"
    assert gpu_check.main([str(out), "--dry-run", "--only", only]) == 1  # the injected faults are failures
    steps = [r for r in _records(out) if "check" not in r]
    assert [r["step"] for r in steps] == ["env", "headline/32x128/hf-sdpa", "headline/32xvar16-512/hf-sdpa",
                                          "headline/1x128/hf-sdpa"]
    status = {r["step"]: r for r in steps}
    assert [status[n]["status"] for n in status] == ["ok", "crashed", "timed_out", "ok"]
    assert status["headline/32x128/hf-sdpa"]["signal"] == "SIGABRT"
    for name in ("headline/1x128/hf-sdpa",):  # real figures after the faults
        assert status[name]["median_s"] > 0 and status[name]["tokens_per_s"] > 0
        assert status[name]["max_abs_err"] <= status[name]["err_bound"]
    checks = [r["check"] for r in _records(out) if r["step"] == "env" and "check" in r]
    assert checks == ["versions", "ceilings"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report["failed"]) == {"headline/32x128/hf-sdpa", "headline/32xvar16-512/hf-sdpa"}
    summary = (out / "summary.md").read_text()
    assert "| 2 | headline/32x128/hf-sdpa | crashed |" in summary and "tiny" in summary


def test_gpu_check_child_keeps_the_checks_before_a_crash(tmp_path, monkeypatch):
    """A process that dies inside stage 1 (a sticky CUDA fault, an abort) keeps every check it finished."""
    out = tmp_path / "out"
    monkeypatch.setenv(gpu_check.FAULT_ENV, "smoke-fp16:attention-bias-fp16=crash")
    assert gpu_check.main([str(out), "--dry-run", "--only", "smoke-fp16"]) == 1
    records = _records(out)
    checks = [r for r in records if "check" in r]
    names = [r["check"] for r in checks]
    assert names[0] == "residual_layernorm-postnorm-fp16" and names[-1] == "attention-varlen-fp16"
    assert "attention-bias-fp16" not in names and len(names) == 17  # 4 row kernels, 12 GEMMs, plain attention
    assert all(r["status"] == "ok" for r in checks), [r for r in checks if r["status"] != "ok"]
    assert records[-1]["step"] == "smoke-fp16" and records[-1]["status"] == "crashed"


REFUSAL = ("========= COMPUTE-SANITIZER\n"
           "========= Error: Target application terminated before first instrumented API call\n")


def test_memcheck_refusal_is_skipped_not_failed():
    """Where compute-sanitizer cannot attach to the device (the forward never ran under it) the step says skipped,
    with the sanitizer's own words; errors it reports, or a forward that fails under it, are failures."""
    step = next(s for s in gpu_check.plan(False) if s.name == "memcheck")
    verdict = gpu_check.status_of(step, {"rc": 255, "timed_out": False, "tail": REFUSAL}, "/nonexistent")
    assert verdict["status"] == "skipped"
    assert "Target application terminated before first instrumented API call" in verdict["memcheck"]
    assert gpu_check.memcheck_verdict(1, REFUSAL + "========= ERROR SUMMARY: 0 errors\n")["status"] == "skipped"
    ok = f"{gpu_check.MEMCHECK_OK} (3, 37, 128) True\n========= ERROR SUMMARY: 0 errors\n"
    assert gpu_check.memcheck_verdict(0, ok)["status"] == "ok"
    assert gpu_check.memcheck_verdict(3, "Invalid __global__ read\n========= ERROR SUMMARY: 2 errors\n") == {
        "status": "failed", "memcheck": "2 memcheck error(s)"}
    assert gpu_check.memcheck_verdict(1, "Traceback...\nRuntimeError: x\n========= ERROR SUMMARY: 0 errors\n")[
        "status"] == "failed"
    summary = gpu_check.check_summary([{"stage": "5", "step": "memcheck", "seconds": 1.0, **verdict}])
    assert "| 5 | memcheck | skipped |" in summary and "cannot run here" in summary


def test_graph_bucket_stays_just_above_the_real_tokens():
    """The graph a benchmark replays covers the cell's real tokens with at most a tile of slack, not the next power
    of two (8,400 tokens would run as 16,384)."""
    assert [harness.graph_bucket(t) for t in (1, 128, 300, 4096, 7883, 8400, 16384)] == [
        16, 128, 512, 4096, 7936, 8448, 16384]
    for cell in harness.CUDA_CELLS:
        tokens = sum(cell.lengths())
        assert tokens <= harness.graph_bucket(tokens) < tokens + 256


def test_gpu_check_shim_maps_fastbert_kernels(tmp_path):
    """The last-resort import path: a sitecustomize that serves fastbert.kernels from kernels/."""
    shim = tmp_path / ".shim"
    shim.mkdir()
    kernels = os.path.join(gpu_check.REPO, "kernels")
    (shim / "sitecustomize.py").write_text(gpu_check.SHIM.format(kernels=kernels))
    env = dict(os.environ, PYTHONPATH=str(shim))
    code = "import sitecustomize, fastbert.kernels as k; print(sitecustomize.__file__); print(k.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=gpu_check.REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    shim_file, kernels_file = out.stdout.split()
    assert shim_file == str(shim / "sitecustomize.py")
    assert kernels_file == os.path.join(kernels, "__init__.py")


def test_cold_machine_compiles_each_key_once_across_processes(tmp_path, monkeypatch):
    """The simulated cold machine is Triton's on-disk cache: a key costs its seconds once, in whichever process needs
    it first; a later process (another step, a background worker) finds it there."""
    slept = []
    monkeypatch.setattr(gpu_check.time, "sleep", slept.append)
    machine = gpu_check.ColdMachine(str(tmp_path))
    assert machine.compile(["a", "b", "a"], 0.2) == 2
    assert slept == [0.2, 0.2]
    other = gpu_check.ColdMachine(str(tmp_path))  # what a second process sees
    assert other.compile(["b", "a", "c"], 0.2) == 1
    assert slept == [0.2, 0.2, 0.2]
    assert machine.compiled() == {"a", "b", "c"}


def test_background_workers_split_every_key():
    """Each key goes to exactly one worker, the same in every process, and the workers share a job's keys."""
    keys = [f"kernel|{i}" for i in range(200)]
    owners = [gpu_check.owner(k, gpu_check.WORKERS) for k in keys]
    assert owners == [gpu_check.owner(k, gpu_check.WORKERS) for k in keys]
    assert set(owners) == set(range(gpu_check.WORKERS))
    assert max(owners.count(w) for w in range(gpu_check.WORKERS)) < 200 / gpu_check.WORKERS * 1.5


def test_gpu_check_cold_start_fits_and_records_compiles(tmp_path):
    """The dry run on a simulated cold machine: each step pays the compiles of the keys it is the first to need
    (bench/compile_keys.json, the GPU run's keys, not the tiny stand-ins'), the background workers compile the
    jobs ahead of the steps, the headline's first fastbert case finds its keys compiled, and every record says what
    it compiled. The timeline closes summary.md."""
    out = tmp_path / "out"
    seconds = 0.2  # the smoke's wait is bounded by 17 x this: long enough for the workers to have started
    only = "env,smoke-bf16,headline/32x128/hf-sdpa,headline/32x128/fastbert-triton"
    assert gpu_check.main([str(out), "--dry-run", "--cold-compile-s", str(seconds), "--only", only]) == 0
    records = _records(out)
    steps = {r["step"]: r for r in records if "check" not in r and r.get("stage") != "bg"}
    assert list(steps) == only.split(",")
    estimate = gpu_check.load_estimate()
    smoke = estimate["smoke:bf16"]
    # the background workers compiled the smoke's keys (while env ran, or while the smoke waited for them): the
    # smoke compiled none itself
    assert steps["smoke-bf16"]["estimated_compiles"] == len(smoke)
    assert steps["smoke-bf16"]["waited_s"] >= 0 and steps["smoke-bf16"]["compiles"] == 0
    assert steps["headline/32x128/fastbert-triton"]["status"] == "ok"
    assert steps["headline/32x128/fastbert-triton"]["median_s"] > 0
    assert "compiles" in steps["headline/32x128/fastbert-triton"] and "compiles" not in steps["env"]
    compiled = gpu_check.ColdMachine(str(out / "cold")).compiled()
    assert set(smoke) | set(estimate["forward:bert-base:32x128:bf16"]) <= compiled
    workers = [r for r in records if r.get("stage") == "bg"]
    assert {r["step"] for r in workers if r["check"] == "smoke:bf16"} == {
        f"precompile-{i}" for i in range(gpu_check.WORKERS)}
    assert all(r["status"] == "ok" for r in workers)
    assert sum(r["compiles"] for r in workers if r["check"] == "smoke:bf16") == len(smoke)
    assert "### Timeline (a simulated cold machine, 0.2 s a compile)" in (out / "summary.md").read_text()


def test_records_read_mid_append_leave_the_partial_line_out(tmp_path):
    """A background worker reads compiled.jsonl while another process appends to it: a line caught without its
    newline is left out (and read whole once written), never a JSON error that fails the worker's job."""
    path = str(tmp_path / "compiled.jsonl")
    gpu_check.append_record(path, {"key": "a"})
    with open(path, "a") as f:
        f.write('{"key": "b", "at": 17')  # an append in flight
    assert gpu_check.read_records(path) == [{"key": "a"}]
    with open(path, "a") as f:
        f.write("}\n")
    assert [r["key"] for r in gpu_check.read_records(path)] == ["a", "b"]
    assert gpu_check.ColdMachine(str(tmp_path)).compiled() == {"a", "b"}
