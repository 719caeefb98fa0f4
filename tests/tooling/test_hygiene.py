"""The suite itself: a test that leaves process-wide state changed fails (tests/conftest.py's guard), so no later
test runs under a flag it did not ask for (a leaked TF32 switch once turned every later fp32 kernel test on a GPU
into tf32 arithmetic)."""
import pathlib

TESTS = pathlib.Path(__file__).parent.parent
REPO = TESTS.parent
CONFTEST = (TESTS / "conftest.py").read_text()
HELPERS = (TESTS / "helpers.py").read_text()  # the conftest imports it


LEAKS = [  # (a line that leaks, what the guard must name)
    ("import torch; torch.backends.cuda.matmul.allow_tf32 = True", "TF32 for fp32 matmuls"),
    ("import os; os.environ['FASTBERT_SOMETHING'] = '1'", "environment (FASTBERT_SOMETHING)"),
    ("import torch; torch.set_default_dtype(torch.float64)", "default dtype"),
    ("from fastbert import dispatch; dispatch._WARNED.add(('attention', 'why'))", "fastbert warned-once set"),
]


def test_the_guard_fails_each_test_that_leaks_global_state_and_passes_one_that_restores(pytester):
    """One run of a test file (one pytest process: each costs the imports of torch, transformers and fastbert):
    each leaking test errors at its teardown, naming what it changed; the clean test after each passes (what the
    leak left is its starting state, not its doing); a test that changes state through monkeypatch and a context
    manager that put it back passes."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(helpers=HELPERS)
    body = "".join(f"def test_leaks_{i}():\n    {leak}\n\n\ndef test_clean_{i}():\n    pass\n\n\n"
                   for i, (leak, _) in enumerate(LEAKS))
    pytester.makepyfile(test_leaky=body + """
import torch
from helpers import tf32_matmuls


def test_tidy(monkeypatch):
    monkeypatch.setenv("FASTBERT_TIDY", "1")
    with tf32_matmuls(not torch.backends.cuda.matmul.allow_tf32):
        pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-v")
    result.assert_outcomes(passed=2 * len(LEAKS) + 1, errors=len(LEAKS))
    for i, (_, words) in enumerate(LEAKS):
        result.stdout.fnmatch_lines([f"*ERROR at teardown of test_leaks_{i}*"])
        result.stdout.fnmatch_lines([f"*the test left global state changed: {words}*"])
    result.stdout.fnmatch_lines(["*test_tidy PASSED*"])


def test_an_xdist_group_runs_on_one_worker(pytester):
    """Under the README's `-n auto --dist loadgroup`, every test of one xdist_group runs in one worker process (the
    repository's conftest.py mends pytest-xdist's group ids for pytest 9.2; without it they spread over the
    workers)."""
    pytester.makeconftest((REPO / "conftest.py").read_text())
    pytester.makepyfile(test_groups="""
import os
import time

import pytest


@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    time.sleep(0.2)  # long enough that an idle worker would take some of them
    with open(f"grouped-{i}.worker", "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    time.sleep(0.2)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=12)
    workers = {path.read_text() for path in pytester.path.glob("grouped-*.worker")}
    assert len(list(pytester.path.glob("grouped-*.worker"))) == 6 and len(workers) == 1, workers


def test_nothing_cites_a_design_file_outside_the_repository():
    """The code's design lives in its own docs/: no source, test, doc or benchmark cites a DESIGN.md or STYLE.md the
    repository does not hold."""
    root = pathlib.Path(__file__).resolve().parents[2]
    citing = []
    for path in root.rglob("*"):
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".cfg") or not path.is_file():
            continue
        parts = path.relative_to(root).parts
        if parts[0] in (".git", "bench") and (parts[0] == ".git" or parts[1:2] == ("results",)):
            continue  # dated result folders are records of their day
        if path == pathlib.Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        for name in ("DESIGN.md", "STYLE.md"):
            if name in text and not (root / name).exists():
                citing.append(f"{path.relative_to(root)}: {name}")
    assert not citing, citing


ROOT = TESTS.parent


def test_kernels_are_imported_as_modules_not_by_name():
    """A reader or an IDE follows a call from the model to the launch: no kernel is reached through an importlib
    string in the package or the kernels."""
    found = []
    for folder in ("fastbert", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            # (kernels/__init__.py uses importlib.machinery for one thing: yielding the top-level name `kernels`
            # to Hugging Face's package, tests/tooling/test_packaging.py)
            for needle in ("import_module(", "__import__(") + (("importlib",) if folder == "fastbert" else ()):
                if needle in text:
                    found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert not found, found


def test_bench_results_hold_data_only():
    """Dated result folders keep what a run wrote (json, logs, summaries); the commands that make figures live in
    bench/ and are maintained there."""
    scripts = [str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*")
               if p.suffix in (".py", ".sh", ".c", ".cpp", ".ipynb") or (p.is_file() and p.stat().st_mode & 0o111)]
    assert not scripts, scripts


def test_every_link_in_the_results_resolves():
    import re
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    missing = [link for link in re.findall(r"\]\(([^)#\s]+)\)", text)
               if "://" not in link and not (ROOT / "bench" / link).exists()]
    assert not missing, missing


def test_every_results_section_names_the_command_that_reproduces_it():
    """Each section of bench/RESULTS.md names a maintained command that reproduces its figures (`pytest bench/...`,
    `python bench/...`, `bash bench/...`; the ahead-of-time figures: `pytest tests/tooling/...`) or says it is
    historical: a figure whose script was retired."""
    import re
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    silent = []
    for section in sections:
        title, body = section.split("\n", 1)
        commands = re.findall(r"(?:pytest|python|bash) ((?:bench|tests)/[\w/.-]*)", body.replace("\n", " "))
        if not commands and "historical" not in body.lower():
            silent.append(title)
        for command in commands:
            if not (ROOT / command).exists():
                silent.append(f"{title}: {command} does not exist")
    assert not silent, silent


def test_the_generic_modules_name_no_op_axis():
    """Dispatch, "auto"'s measuring, the safety net and CUDA graphs are generic over the op units: an op's axes (its
    Extras and Variant fields) are named only in its unit, its kernel and the layers that use them, so adding one
    touches the unit and the kernel (docs/design.md)."""
    import re

    from fastbert import units
    axes = set(units.attention.Extras._fields) | set(units.attention.Variant._fields) \
        | set(units.bias_gelu.Variant._fields) | set(units.residual_layernorm.Variant._fields)
    named = []
    for name in ("dispatch", "measure", "fallback", "graphs"):
        text = (ROOT / "fastbert" / f"{name}.py").read_text()
        named += [f"{name}.py: {axis}" for axis in axes if re.search(rf"\b{axis}\b", text)]
    assert not named, named


def test_every_package_path_the_tree_names_exists():
    """A comment, doc or result section that names fastbert/<file>.py or kernels/<file>.py names a file the tree
    holds (dated result folders excepted: they are records of their day), and nothing names a folder outside the
    repository."""
    import re
    import subprocess
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    stale = []
    for rel in tracked.stdout.split():
        path = ROOT / rel
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".cfg", ".txt") or rel.startswith("bench/results/") \
                or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for name in set(re.findall(r"(?<![\w/.])(?:fastbert|kernels)/[\w/-]*\.py\b", text)):
            if not (ROOT / name).exists():
                stale.append(f"{rel}: {name}")
        for outside in ("../shared", "/work/", "../.library"):
            if outside in text and path != pathlib.Path(__file__).resolve():
                stale.append(f"{rel}: {outside}")
    assert not stale, stale


def test_test_modules_have_distinct_basenames():
    """tests/ and bench/ are not packages: pytest imports each test file by its basename, so two files of one name in
    different folders stop the whole collection ("import file mismatch")."""
    seen: dict = {}
    for path in sorted([*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "bench").rglob("test_*.py")]):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def imports_of_test_modules(root: pathlib.Path) -> list:
    """'<file>: <module>' for each import, in a test module under root/tests or root/bench, of another test module
    (a module named like one of those test_*.py files)."""
    import ast
    files = sorted([*(root / "tests").rglob("test_*.py"), *(root / "bench").rglob("test_*.py")])
    test_modules = {path.stem for path in files}
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # `from . import test_x`, `from .test_x import y`
                names = [node.module or "", *(alias.name for alias in node.names)]
            else:
                continue
            found += [f"{path.relative_to(root)}: {name}" for name in names
                      if set(name.split(".")) & test_modules]
    return found


def test_no_test_module_imports_another():
    """A test module that imports another runs that module's top level (its marks, fixtures and whatever it sets up)
    inside its own, and breaks when that file is renamed or split: what tests share lives in tests/helpers.py (the
    benchmarks': bench/harness.py)."""
    found = imports_of_test_modules(ROOT)
    assert not found, f"test modules importing test modules (move what they share to tests/helpers.py): {found}"


def test_an_import_of_a_test_module_is_found(tmp_path):
    """The check above on a tree of its own: each form of import of a test module is named (plain, from, inside a
    function, dotted, relative), the helpers and the libraries are not."""
    (tmp_path / "tests" / "model").mkdir(parents=True)
    (tmp_path / "bench").mkdir()
    (tmp_path / "tests" / "model" / "test_a.py").write_text("import torch\nfrom helpers import DEVICE\n")
    (tmp_path / "tests" / "model" / "test_b.py").write_text(
        "from test_a import X\n\n\ndef test_b():\n    import test_c\n")
    (tmp_path / "tests" / "test_c.py").write_text("import bench.test_d as d\nfrom . import test_a\n")
    (tmp_path / "bench" / "test_d.py").write_text("from bench import harness\nimport pytest_benchmark\n")
    assert imports_of_test_modules(tmp_path) == ["tests/model/test_b.py: test_a", "tests/model/test_b.py: test_c",
                                                 "tests/test_c.py: bench.test_d", "tests/test_c.py: test_a"]
