"""Files and lines per folder, and the longest functions, of the working tree or any git revision.

    python bench/code_shape.py                         # the working tree
    python bench/code_shape.py --rev e08a89a --rev HEAD --top 12

Counts the Python files under fastbert/ and kernels/ (lines as `wc -l` counts them) and, per folder, how many there
are; then the longest functions, methods and classes by lines, decorators excluded. What docs/design.md's "The
shape of the code" table is made of.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("fastbert", "kernels")


def tree_at(rev: str | None, into: str) -> str:
    """A folder holding fastbert/ and kernels/ as they are at `rev` (None: the working tree itself)."""
    if rev is None:
        return ROOT
    archive = os.path.join(into, "tree.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", ROOT, "archive", rev, *FOLDERS], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def shape(root: str) -> tuple[dict, list]:
    """({folder: (files, lines)}, [(lines, "path:function")]) of the Python files under FOLDERS."""
    folders, functions = {}, []
    for top in FOLDERS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                folder = os.path.dirname(rel) + "/"
                files, lines = folders.get(folder, (0, 0))
                folders[folder] = (files + 1, lines + source.count("\n"))
                for node in ast.walk(ast.parse(source)):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
                    elif isinstance(node, ast.ClassDef):
                        functions.append((node.end_lineno - node.lineno + 1, f"{rel}:class {node.name}"))
    return folders, sorted(functions, reverse=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[], help="git revision (repeatable); default: the tree")
    parser.add_argument("--top", type=int, default=10, help="how many of the longest functions to list")
    args = parser.parse_args(argv)
    for rev in args.rev or [None]:
        with tempfile.TemporaryDirectory() as tmp:
            folders, functions = shape(tree_at(rev, tmp))
        print(f"== {rev or 'working tree'}")
        print("| folder | files | lines |\n|---|---|---|")
        for folder, (files, lines) in sorted(folders.items()):
            print(f"| {folder} | {files} | {lines:,} |")
        total_files = sum(f for f, _ in folders.values())
        total_lines = sum(n for _, n in folders.values())
        print(f"| all | {total_files} | {total_lines:,} |")
        print(f"\nlongest functions and classes ({args.top}):")
        for lines, name in functions[:args.top]:
            print(f"  {lines:4d}  {name}")
        print()


if __name__ == "__main__":
    main()
