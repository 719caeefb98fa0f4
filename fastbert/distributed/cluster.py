"""Connecting this process to a Ray cluster for one piece of work, and leaving it as it was after: what `encode
--ray` (fastbert/distributed/job.py) and `serve --ray` (fastbert/serve/ray.py) both do."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def connected(address: str | None, log_to_driver: bool = True):
    """This process connected to a Ray cluster (ray.init(address): None follows $RAY_ADDRESS, then a cluster started
    on this machine with `ray start`, else a new local one), yielding its resources (ray.cluster_resources());
    disconnected after, a cluster that ray.init started here stopping with it, and the environment variables ray.init
    set (PYTHONBREAKPOINT among them) put back. A process already connected is left as it is. log_to_driver: the
    workers' output here too (it is always in Ray's logs, /tmp/ray/session_latest/logs on each node)."""
    import ray

    environment = dict(os.environ)
    here = not ray.is_initialized()
    if here:
        ray.init(address=address, log_to_driver=log_to_driver)
    try:
        yield ray.cluster_resources()
    finally:
        if here:
            ray.shutdown()
            for name in set(os.environ) | set(environment):
                if os.environ.get(name) != environment.get(name):
                    if name in environment:
                        os.environ[name] = environment[name]
                    else:
                        del os.environ[name]
