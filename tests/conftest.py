import os
import tempfile

import pytest

# The built-in model is written once per test session into a private folder, never into ~/.cache.
os.environ.setdefault("HYBRIDCACHE_HOME", tempfile.mkdtemp(prefix="hybridcache-test-home-"))
os.environ.setdefault("HYBRIDCACHE_DEBUG", "1")  # the engine checks the cache whenever it goes idle
# The tests' models are tiny: one intra-op thread per process runs them faster than one per core, and the servers,
# workers and interpreter children these tests start (they inherit it) then do not fight the test process for cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the Hugging Face hub: a hub id the (fake) local cache lacks is an error, not a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Nor any other outside server: no test verifies a public certificate (the https tests bring their own CA or skip
# verification). Every httpx client (each httpx.get / post, each OpenAI or Anthropic client) loads its CA bundle as
# it is made (SSL_CERT_FILE's, else certifi's): ~30 ms on the 2-core test machine, ~110 s of tests/server, router and
# bench (2,008 clients). The tests' processes get an empty CA folder instead, which OpenSSL reads only when asked.
os.environ.pop("SSL_CERT_FILE", None)
os.environ["SSL_CERT_DIR"] = tempfile.mkdtemp(prefix="hybridcache-test-no-ca-")


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs: only the parents that will run are planned
def pytest_collection_modifyitems(config, items):
    """Plan the kernel tests' Triton-interpreter children (tests/kernels/interpreter.py)."""
    from tests.kernels.interpreter import plan_children

    plan_children(items)


def pytest_runtest_logstart(nodeid, location):
    """Start the interpreter children planned to start with this test (tests/kernels/interpreter.py)."""
    from tests.kernels.interpreter import start_early

    start_early(nodeid)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hooks: unknown without it)
def pytest_xdist_make_scheduler(config, log):
    """`-n N --dist loadfile`: each file's tests on one worker, and each folder's Triton-interpreter parents too
    (tests/xdist_scheduling.py); xdist's own scheduling for the other `--dist` modes."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_scheduling import LoadFileParentsScheduling

    return LoadFileParentsScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tell each xdist worker whether a folder's interpreter parents all come to one worker."""
    from tests.xdist_scheduling import PARENTS_TOGETHER

    node.workerinput[PARENTS_TOGETHER] = node.config.getvalue("dist") == "loadfile"


def pytest_sessionfinish(session, exitstatus):
    from tests.kernels.interpreter import stop_children

    stop_children()
