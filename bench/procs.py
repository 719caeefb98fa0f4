"""This machine's processes as Linux's /proc shows them (their command lines, their ancestry, their CPU time), and
the local Ray cluster the tests and benchmarks start: for those that watch the processes a Ray cluster or a server
starts."""
from __future__ import annotations

import contextlib
import glob
import os


@contextlib.contextmanager
def local_ray_cluster():
    """A local Ray cluster for a test module or a benchmark: 2 CPUs, no dashboard, a 200 MiB object store, the
    workers' output in Ray's logs only. Yields its address. ray.init sets variables in this process
    (PYTHONBREAKPOINT, RAY_*) that outlive ray.shutdown: they are put back with the cluster."""
    import ray

    environment = dict(os.environ)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 ** 2, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environment)


def command_lines() -> dict[int, str]:
    """{pid: its command line, the arguments joined by spaces} of every process readable now."""
    lines = {}
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                lines[int(path.split("/")[2])] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass  # it ended meanwhile
    return lines


def parent(pid: int) -> int:
    """The parent's pid (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def descends_from(pid: int, ancestor: int | None = None) -> bool:
    """Started by `ancestor` (this process by default) or by a process it started, at any depth: Ray's raylet
    starts the workers, ray.init the raylet, and another Ray cluster on the machine runs processes of the same
    names."""
    ancestor = os.getpid() if ancestor is None else ancestor
    while pid > 1:
        pid = parent(pid)
        if pid == ancestor:
            return True
    return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
