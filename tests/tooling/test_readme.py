"""The README is the landing page: it shows the two commands CI runs (.ci/commands) verbatim, and every link in it
and in docs/ points at a file of the repository."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def commands():
    return [line for line in read(".ci", "commands").splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_two_commands_and_the_readme_shows_them_verbatim():
    main_job, tests = commands()
    assert "python -m fastbert" in main_job and "pytest" in tests
    shown = [line[4:] for line in read("README.md").splitlines() if line.startswith("    ") and "pip install" in line]
    assert shown == [main_job, tests], "the README's indented commands must be .ci/commands, in that order"
    assert ".ci/commands" in read(".ci", "run")


DOCS = ["README.md"] + [os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))]


@pytest.mark.parametrize("page", DOCS)
def test_relative_links_point_at_files(page):
    folder = os.path.dirname(os.path.join(ROOT, page))
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(page))
    local = [link for link in links if "://" not in link]
    missing = [link for link in local if not os.path.exists(os.path.normpath(os.path.join(folder, link)))]
    assert not missing, f"{page} links to files that do not exist: {missing}"
