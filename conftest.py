"""The suite's one hook that spans tests/ and bench/: xdist groups that hold under pytest 9.2.

`--dist loadgroup` (the README's test command) sends the tests of one `xdist_group` to one worker: one process's
compiles (tests/tooling/test_aot.py), one local Ray cluster at a time. pytest-xdist marks them by appending "@group"
to each node id, but it writes `item._nodeid`, and pytest 9.2 keeps a node's id in `item._id`: unmended, every group is
spread over the workers in silence (each worker then compiles the same lists, or starts its own Ray cluster).
tests/tooling/test_hygiene.py checks that a group lands on one worker.
"""
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = {str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                 for mark in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)
