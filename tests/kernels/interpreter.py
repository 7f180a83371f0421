"""Run the test files' interpreted kernel tests in child processes under `TRITON_INTERPRET=1`.

Triton reads `TRITON_INTERPRET` when it is imported, so a test session that has already imported it cannot switch
to the interpreter: the kernel test files each keep one parent test, made by `interpreted_in_child(selector)`,
whose file's interpreted tests (those `pytest -k selector` picks in that file; a selector must match only the
interpreted tests) run in a child pytest with the interpreter on. A parent never runs in a child, so no child
spawns another. The markers every kernel test file uses live here too.

The children are batched by folder: one child runs a batch's files together (each file with its own selector), so
the ~3 s a child spends importing torch and triton is paid per batch, not per file. Each parent waits for its own
batch, then checks its own file's results only: a file's failure fails its own parent, not its neighbours'.
When the parents' folder comes after another folder in the session (tests/kernels after tests/engine), its one
batch starts with that other folder's first test (`plan_children`, called by tests/conftest.py once the session's
items are chosen; `start_early`, called as each test starts): the tests before it mostly run in the test process
on one core, so the child computes on the other and is done, or nearly, when its parents run. A folder that the
session starts with gets `NUM_BATCHES` batches instead, started by its first parent (the batches compute side by
side while the parent waits). A batch whose parents never ran is stopped when the session ends
(`stop_children`).

Under pytest-xdist each worker plans alike, but a worker runs only the parents sent to it. With `--dist loadfile`
(scripts/test.sh) a folder's parents are one work unit that one worker runs (tests/xdist_scheduling.py): their folder
gets one batch, started by its first parent (no early start: the other worker keeps the other core busy). Under
another `--dist` a folder's parents may be split between workers: each parent then runs its own child."""

from __future__ import annotations

import faulthandler
import functools
import inspect
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (in the child process of a parent)
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BAD_TAGS = ("failure", "error", "skipped")  # a JUnit test case's children that say it did not pass
NUM_BATCHES = 2  # of a folder the session starts with: one per core of the 2-core machine the suite is timed on


class Parent:
    """One test file's part of a batch: its file, its selector (`pytest -k` within that file) and its timeout."""

    def __init__(self, test_file: str, selector: str, timeout: float) -> None:
        self.test_file, self.selector, self.timeout = Path(test_file).resolve(), selector, timeout
        self.batch: Batch | None = None  # set by `plan_children` (or, unplanned, a batch of its own)
        self.refusal: str | None = None  # why this parent fails without running (set by `plan_children`)

    @property
    def module(self) -> str:
        """The dotted module name that the child's JUnit report gives as each of this file's test classnames."""
        return ".".join(self.test_file.relative_to(REPO_ROOT).with_suffix("").parts)

    def check(self) -> None:
        if self.refusal is not None:
            pytest.fail(self.refusal)
        if self.batch is None:
            self.batch = Batch([self])
        for batch in _siblings(self.batch):
            batch.start()
        self.batch.check(self)


class Batch:
    """Several files' interpreted tests in one child pytest: `start` it (once), `check(parent)` waits for it and
    asserts that the parent's file ran at least one test and every one of them passed (none skipped)."""

    def __init__(self, parents: list[Parent]) -> None:
        self.parents = parents
        self.timeout = sum(parent.timeout for parent in parents)
        self.process: subprocess.Popen | None = None
        self.folder: tempfile.TemporaryDirectory | None = None
        self.returncode: int | None = None

    def selector(self) -> str:
        """One `-k` expression: a test is picked when its file's name and that file's selector both match (`-k`
        matches a test's name and its parents' names, the module's file name among them)."""
        return " or ".join(f"({parent.test_file.name} and ({parent.selector}))" for parent in self.parents)

    def start(self) -> None:
        if self.process is not None:
            return
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.folder = tempfile.TemporaryDirectory(prefix="interpreted-")  # (removed by `stop`)
        folder = Path(self.folder.name)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(folder / "tmp"),
                   f"--junitxml={folder / 'report.xml'}", *(str(p.test_file) for p in self.parents),
                   "-k", self.selector()]
        with open(folder / "output.txt", "w") as output:  # a file, not a pipe: nobody reads it while it runs
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output,
                                            stderr=subprocess.STDOUT, text=True)

    def wait(self) -> None:
        """Wait for the batch, at most its summed timeout. pytest's `faulthandler_timeout` dump of this waiting
        process is cancelled first: the wait has its own limit, and the child dumps its own stacks on a hang."""
        self.start()
        if self.returncode is None:
            faulthandler.cancel_dump_traceback_later()
            try:
                self.returncode = self.process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.kill()  # (its other parents then fail on its return code)
                raise

    def check(self, parent: Parent) -> None:
        self.wait()
        folder = Path(self.folder.name)
        text = (folder / "output.txt").read_text(errors="replace")
        # 0: every test passed; 1: some failed (maybe in another file: read per file below); else it broke
        assert self.returncode in (0, 1), text[-9000:]
        outcomes = {}  # (classname, name) -> "failure" / "error" / "skipped" tags ([] when it passed)
        for case in ElementTree.parse(folder / "report.xml").iter("testcase"):
            classname = case.get("classname", "")  # the module, or the module then a class: a.b.test_x.TestY
            if classname == parent.module or classname.startswith(parent.module + "."):
                outcomes[classname, case.get("name")] = [c.tag for c in case if c.tag in BAD_TAGS]
        bad = {name: tags for name, tags in outcomes.items() if tags}
        assert outcomes and not bad, f"{parent.test_file.name}: {bad or 'no test ran'}\n{text[-9000:]}"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.returncode = self.process.wait()

    def stop(self) -> None:
        """Kill the child if it still runs and remove its files (at the session's end)."""
        self.kill()
        if self.folder is not None:
            self.folder.cleanup()


def interpreted_in_child(selector: str, timeout: float = 600):
    """Make the decorated function (its body is not run) the parent test of its file's interpreted tests: they
    run (`pytest -k selector` within the file) in a child process under the interpreter, batched with other
    files', and the parent fails unless they all passed and skipped nothing. Skipped in a child itself."""
    def make(function):
        planned = Parent(inspect.getfile(function), selector, timeout)

        @functools.wraps(function)
        def parent() -> None:
            if INTERPRETED:
                pytest.skip("the parent of the interpreted tests (never spawns itself)")
            pytest.importorskip("triton")
            planned.check()

        parent.interpreter_parent = planned
        return parent
    return make


_BATCHES: list[Batch] = []  # every planned batch, in the session's order
_EARLY_STARTS: dict[str, list[Batch]] = {}  # node id of a test -> the batches that start as it starts


def plan_children(items) -> None:
    """Plan the batches of the collected parents (leaving out those skipped by a condition known now), by folder
    in the session's order: a folder whose tests come after another folder's gets one batch, started with that
    other folder's first test; the session's first folder gets `NUM_BATCHES`, dealt round-robin, started with its
    first parent. In a pytest-xdist worker: one batch per folder, started with its first parent, where a folder's
    parents all come to one worker (`--dist loadfile`); none otherwise (each parent then runs its own child)."""
    _BATCHES.clear()
    _EARLY_STARTS.clear()
    workerinput = getattr(items[0].config, "workerinput", None) if items else None
    xdist_worker = workerinput is not None
    if xdist_worker:
        from tests.xdist_scheduling import PARENTS_TOGETHER, parents_unit

        if not workerinput.get(PARENTS_TOGETHER):
            return
    by_folder: dict[Path, list[Parent]] = {}
    first_items: dict[Path, str] = {}  # folder -> node id of its first test, in the session's order
    for item in items:
        first_items.setdefault(item.path.parent, item.nodeid)
        parent = getattr(getattr(item, "function", None), "interpreter_parent", None)
        if parent is not None and xdist_worker and parents_unit(item.nodeid) is None:
            parent.refusal = (f"{item.nodeid}: the name of an interpreted_in_child parent must hold 'interpreter' and "
                              "end with 'subprocess': under -n N --dist loadfile, tests/xdist_scheduling.py sends a "
                              "folder's parents to one worker by their names")
            continue
        if parent is not None and not any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")):
            by_folder.setdefault(parent.test_file.parent, []).append(parent)
    folders = list(first_items)
    for folder, parents in by_folder.items():
        index = folders.index(folder) if folder in folders else 0
        num_batches = NUM_BATCHES if index == 0 and not xdist_worker else 1
        batches = [Batch(parents[start::num_batches]) for start in range(min(num_batches, len(parents)))]
        for batch in batches:
            for parent in batch.parents:
                parent.batch = batch
        _BATCHES.extend(batches)
        if index > 0 and not xdist_worker:
            _EARLY_STARTS.setdefault(first_items[folders[index - 1]], []).extend(batches)


def start_early(nodeid: str) -> None:
    """Start the batches planned to start with this test (called as each test starts, by tests/conftest.py)."""
    for batch in _EARLY_STARTS.pop(nodeid, ()):
        batch.start()


def _siblings(batch: Batch) -> list[Batch]:
    """The planned batches of `batch`'s folder (itself only, when unplanned)."""
    folder = batch.parents[0].test_file.parent
    planned = [b for b in _BATCHES if b.parents[0].test_file.parent == folder]
    return planned if batch in planned else [batch]


def stop_children() -> None:
    for batch in _BATCHES:
        batch.stop()
