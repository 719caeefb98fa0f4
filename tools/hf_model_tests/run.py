"""transformers' own model tests of every family fastbert claims: stock, with fastbert padded, with fastbert
padding-free; then the comparison, test by test (compare.py). One command:

    python tools/hf_model_tests/run.py --tree TRANSFORMERS_CHECKOUT --sdist transformers-X.tar.gz --dest DIR \
        [--families deberta_v2 distilbert ...] [--modes stock fb fbpf] [--timeout 300] [--deps DIR]

--tree: a transformers checkout whose main carries tests/ (a work tree, or a bare git directory such as the one
`fetch` brings: its HEAD is read). --sdist: the installed release's source archive (`pip download
transformers==$(python -c 'import transformers; print(transformers.__version__)') --no-deps --no-binary :all:`), or
a folder it was unpacked to; its tests/*.py (the common test files) go over the checkout's. --dest: a folder outside
this repository that becomes the test folder (set up once; fastbert_plugin.py is copied in again on every run).
--deps: a folder on PYTHONPATH with the test files' own needs (parameterized, httpx, pytest-timeout), if they are
not in the environment.

Each family's test file runs once per mode, one process at a time, writing DIR/results/<mode>-<family>.{xml,log,
jsonl}, and a line per run in DIR/results/RUNS.txt (the date, the fastbert commit, the versions, the CPU); a family's
runs are skipped when its results exist (--again reruns them). fastbert is taken as committed (--commit, default
HEAD; exported under DIR/fastbert-src), so that changes in progress in the working tree do not enter a run. It needs
no GPU: fastbert runs its PyTorch twins (kernels="torch").
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MODES = {"stock": [], "fb": ["--fastbert"], "fbpf": ["--fastbert", "--fastbert-padding-free"]}
# what the model test files import besides their own folder
SUPPORT = ("tests/__init__.py", "tests/models/__init__.py", "tests/exporters", "tests/generation", "tests/pipelines",
           "tests/utils", "tests/fixtures", "utils/test_module")
CONFTEST = '''\
"""Written by fastbert's tools/hf_model_tests/run.py: the fastbert plugin, transformers' markers, offline."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402 - after the offline switch, which transformers reads at import

pytest_plugins = ["fastbert_plugin"]

# transformers 5.25 dropped PreTrainedModel._is_stateful; tests/generation/test_utils.py of a checkout from before
# reads it (its packed-sequence and assisted-decoding tests then fail stock with AttributeError): its old default
if not hasattr(transformers.PreTrainedModel, "_is_stateful"):
    transformers.PreTrainedModel._is_stateful = False

MARKERS = {markers!r}


def pytest_configure(config):
    for name in MARKERS:
        config.addinivalue_line("markers", f"{{name}}: transformers' marker")
'''
MARKERS = ("slow", "is_pipeline_test", "is_staging_test", "accelerate_tests", "not_device_test", "torch_compile_test",
           "torch_export_test", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "all_flash_attn_test",
           "training_ci", "tensor_parallel_ci", "fsdp_ci", "generate", "kernels")


def claimed() -> list[str]:
    """The tests/models folder of every model_type fastbert claims (fastbert/families.py)."""
    sys.path.insert(0, REPO)
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from fastbert import families

    # transformers' folder of each model_type (gemma3_text's tests are tests/models/gemma3)
    return list(dict.fromkeys(model_type_to_module_name(t) for t in families.MODEL_TYPES))


def _is_git_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "HEAD")) and os.path.isdir(os.path.join(path, "objects"))


def _copy_from_tree(tree: str, paths: list[str], dest: str) -> None:
    """paths (files or folders) of the checkout into dest, at the same relative paths."""
    if _is_git_dir(tree):
        archive = subprocess.run(["git", "--git-dir", tree, "archive", "--format=tar", "HEAD", *paths],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        return
    for path in paths:
        src, dst = os.path.join(tree, path), os.path.join(dest, path)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst)


def _common_tests(sdist: str, dest: str) -> int:
    """The release's tests/*.py (test_modeling_common.py, ...) over the checkout's; returns how many."""
    tests = os.path.join(dest, "tests")
    count = 0
    if os.path.isdir(sdist):
        root = os.path.join(sdist, "tests")
        for name in os.listdir(root):
            if name.endswith(".py"):
                shutil.copy2(os.path.join(root, name), os.path.join(tests, name))
                count += 1
        return count
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py"):
                with archive.extractfile(member) as src, open(os.path.join(tests, parts[2]), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                count += 1
    return count


def setup(tree: str, sdist: str, dest: str, folders: list[str]) -> None:
    """Steps 1-3 of the README: the model test files and what they import, the release's common files over them,
    src/transformers linked to the installed package, the conftest and the plugin."""
    import transformers

    os.makedirs(dest, exist_ok=True)
    marker = os.path.join(dest, ".fastbert-setup")
    if not os.path.exists(marker):
        wanted = [f"tests/models/{f}" for f in folders]
        _copy_from_tree(tree, [*SUPPORT, *wanted], dest)
        n = _common_tests(sdist, dest)
        src = os.path.join(dest, "src")
        os.makedirs(src, exist_ok=True)
        link = os.path.join(src, "transformers")
        if not os.path.lexists(link):
            os.symlink(os.path.dirname(transformers.__file__), link)
        with open(os.path.join(dest, "conftest.py"), "w") as f:
            f.write(CONFTEST.format(markers=MARKERS))
        with open(marker, "w") as f:
            f.write(f"tree {tree}\nsdist {sdist} ({n} common test files)\ntransformers {transformers.__version__}\n")
    missing = [f for f in folders if not os.path.isdir(os.path.join(dest, "tests", "models", f))]
    if missing:  # a family added since the folder was set up
        _copy_from_tree(tree, [f"tests/models/{f}" for f in missing], dest)
    shutil.copy2(os.path.join(HERE, "fastbert_plugin.py"), os.path.join(dest, "fastbert_plugin.py"))


def snapshot(dest: str, commit: str) -> tuple[str, str]:
    """fastbert as committed (not the working tree, which may hold changes in progress) under dest; returns
    (the folder to put on PYTHONPATH, the full commit id)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    where = os.path.join(dest, "fastbert-src", sha[:12])
    if not os.path.isdir(where):
        os.makedirs(where + ".part", exist_ok=True)
        archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", sha], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", where + ".part"], input=archive, check=True)
        os.rename(where + ".part", where)
    return where, sha


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores visible"
    except OSError:
        pass
    return f"{os.cpu_count()} cores visible"


def run_family(dest: str, family: str, mode: str, timeout: int, deps: str | None, src: str = REPO,
               commit: str = "working tree") -> float:
    """One family's model test file in one mode; returns the seconds it took."""
    results = os.path.join(dest, "results")
    os.makedirs(results, exist_ok=True)
    stem = os.path.join(results, f"{mode}-{family}")
    test_file = f"tests/models/{family}/test_modeling_{family}.py"
    cmd = [sys.executable, "-m", "pytest", test_file, "-p", "no:cacheprovider", "-q", "-rA", "--rootdir", ".",
           f"--timeout={timeout}", "--junitxml", f"{stem}.xml", *MODES[mode]]
    if mode != "stock":
        cmd += ["--fastbert-log", f"{stem}.jsonl"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (dest, src, deps, env.get("PYTHONPATH")) if p)
    start = time.time()
    with open(f"{stem}.log", "w") as log:
        subprocess.run(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT)
    took = time.time() - start
    with open(f"{stem}.log") as log:
        tail = [line.strip() for line in log if line.strip()][-1:]
    import torch
    import transformers

    line = (f"{time.strftime('%Y-%m-%d %H:%M')} {mode:5} {family:12} {took:6.0f} s  fastbert {commit}, "
            f"transformers {transformers.__version__}, torch {torch.__version__}, {_cpu()}: "
            f"{tail[0] if tail else ''}")
    with open(os.path.join(results, "RUNS.txt"), "a") as runs:
        runs.write(line + "\n")
    print(line, flush=True)
    return took


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="transformers checkout (work tree or git directory) with tests/")
    parser.add_argument("--sdist", help="the installed release's sdist (.tar.gz) or its unpacked folder")
    parser.add_argument("--dest", required=True, help="the test folder to set up and run in (outside this repo)")
    parser.add_argument("--families", nargs="*", help="tests/models folders (default: every family fastbert claims)")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--timeout", type=int, default=300, help="pytest-timeout per test, seconds")
    parser.add_argument("--deps", help="a folder put on PYTHONPATH (parameterized, httpx, pytest-timeout)")
    parser.add_argument("--again", action="store_true", help="rerun families whose results exist")
    parser.add_argument("--commit", default="HEAD",
                        help="the fastbert commit to test, exported from git (default HEAD); 'worktree': the files "
                             "as they are now")
    parser.add_argument("--compare-only", action="store_true", help="only print the comparison of existing results")
    args = parser.parse_args(argv)
    dest = os.path.abspath(args.dest)
    folders = args.families or claimed()
    if not args.compare_only:
        if not os.path.exists(os.path.join(dest, ".fastbert-setup")) and not (args.tree and args.sdist):
            parser.error("the test folder is not set up yet: give --tree and --sdist")
        setup(args.tree, args.sdist, dest, folders)
        src, commit = (REPO, "working tree") if args.commit == "worktree" else snapshot(dest, args.commit)
        for family in folders:
            for mode in args.modes:
                if not args.again and os.path.exists(os.path.join(dest, "results", f"{mode}-{family}.xml")):
                    continue
                run_family(dest, family, mode, args.timeout, args.deps, src, commit[:12])
    sys.path.insert(0, HERE)
    import compare

    compare.main(os.path.join(dest, "results"), folders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
