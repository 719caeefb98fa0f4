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


def test_gpu_check_stages_are_valid_pytest_arguments():
    """Every benchmark stage names a real file and real cells, and the capped stages fit the 8-minute call."""
    from bench import harness
    cells = {c.name for c in harness.CUDA_CELLS}
    for dry_run in (False, True):
        stages = gpu_check.bench_stages(dry_run)
        assert [name for name, _, _ in stages][0] == "headline"
        for name, args, cap in stages:
            assert os.path.exists(os.path.join(gpu_check.REPO, args[0])), args[0]
            assert cap <= 240
            if not dry_run and "--bench-cells" in args:
                assert set(args[args.index("--bench-cells") + 1].split(",")) <= cells
        if not dry_run:
            assert sum(cap for _, _, cap in stages) + 90 + 60 <= 450  # + the "auto" table, the tests' minimum


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
