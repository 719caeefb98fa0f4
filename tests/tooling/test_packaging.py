"""The distribution ships the Triton kernels as fastbert.kernels, never as a top-level `kernels` package (HF's
`kernels` package owns that import name, and transformers probes for it)."""
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The distribution as `pip wheel` builds it from this checkout (built once for the module)."""
    folder = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(folder), REPO], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (name,) = [f for f in os.listdir(folder) if f.endswith(".whl")]
    return folder / name


def test_wheel_holds_fastbert_kernels_and_no_top_level_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for op in ("qkv_projection", "attention", "bias_gelu", "residual_layernorm", "gemm"):
        assert f"fastbert/kernels/{op}.py" in names
    assert "fastbert/modeling.py" in names
    source = {str(path.relative_to(REPO)) for path in pathlib.Path(REPO, "fastbert").rglob("*.py")}
    assert source and not source - set(names), sorted(source - set(names))  # every subpackage (layers/, units/)
    assert "fastbert/distributed/job.py" in names
    assert "fastbert/cli/main_job.py" in names and "fastbert/cli/encode.py" in names  # the two commands
    assert not [n for n in names if n.startswith("kernels/")]
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["fastbert"]


def test_distribution_metadata(wheel):
    """Distributed as fastbert-triton ("fastbert" on the index is another project), imported as fastbert; Apache-2.0
    with the license text in the wheel; the README as the long description; the transformers range CI tests."""
    assert wheel.name.startswith("fastbert_triton-")
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Name: fastbert-triton" in metadata and "License: Apache-2.0" in metadata
    assert "Classifier: License :: OSI Approved :: Apache Software License" in metadata
    assert "Requires-Dist: transformers<6,>=4.41" in metadata
    assert "Description-Content-Type: text/markdown" in metadata and "## The two commands" in metadata
    license_text = archive.read(next(n for n in archive.namelist() if n.endswith("/LICENSE"))).decode()
    assert "Apache License" in license_text and "END OF TERMS AND CONDITIONS" in license_text


def test_transformers_does_not_mistake_our_kernels_for_hfs():
    """fastbert.kernels is never the top-level `kernels` transformers probes: with Hugging Face's package installed
    (a dependency of transformers 5.25 on), `kernels` is that package; without it, transformers finds none."""
    import importlib.metadata

    from transformers.utils import import_utils

    import fastbert.kernels  # noqa: F401  (imported, as a model forward on CUDA would)
    assert fastbert.kernels.__name__ == "fastbert.kernels"
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert not import_utils.is_kernels_available()
        return
    import kernels
    assert os.path.realpath(kernels.__file__) != os.path.realpath(os.path.join(REPO, "kernels", "__init__.py"))


def test_the_top_level_kernels_folder_yields_to_hf_kernels(tmp_path):
    """Run from the repository root (python -m fastbert, pytest), `import kernels` finds this repository's kernels/
    first; it must hand over to Hugging Face's `kernels` package where one is installed (transformers 5.25 imports it
    at import time), and otherwise stay an empty module that imports nothing (transformers' probe then reads it as
    absent)."""
    hf = tmp_path / "site" / "kernels"
    hf.mkdir(parents=True)
    (hf / "__init__.py").write_text("MARK = 'hf'\n")
    probe = "import sys, kernels; print(getattr(kernels, 'MARK', '-'), kernels.__file__, 'triton' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    mark, where, _ = out.stdout.split()
    assert mark == "hf" and where == str(hf / "__init__.py")
    env.pop("PYTHONPATH")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    mark, where, triton_imported = out.stdout.split()
    ours = where == os.path.join(REPO, "kernels", "__init__.py")
    assert not ours or triton_imported == "False", out.stdout  # ours: an empty module; else an installed one
