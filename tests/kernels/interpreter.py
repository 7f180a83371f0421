"""Run a test file's interpreted kernel tests in a child process under `TRITON_INTERPRET=1`.

Triton reads `TRITON_INTERPRET` when it is imported, so a test session that has already imported it cannot switch
to the interpreter: the kernel test files each keep one parent test, made by `interpreted_in_child(selector)`, whose
child runs `pytest -k selector` on that file with the interpreter on (a selector must match only the interpreted
tests; a parent never runs in a child, so no child spawns another). The markers every kernel test file uses live
here too.

Children run one ahead: when a parent runs, the next parent's child of the same folder (in the session's order,
`plan_children`, called at collection by tests/conftest.py) is started too, so on two cores one child runs while
the parent waits for the other; the parent then waits for its own, started earlier. Each child writes to its own
files, and a child whose parent never ran is stopped when the session ends (`stop_children`)."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (in the child process of a parent)
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Child:
    """One file's interpreted tests in a child pytest: `start` it (once), `check` waits for it and asserts that it
    passed and skipped nothing."""

    def __init__(self, test_file: str, selector: str, timeout: float) -> None:
        self.test_file, self.selector, self.timeout = Path(test_file), selector, timeout
        self.process: subprocess.Popen | None = None
        self.output = None

    def start(self) -> None:
        if self.process is not None:
            return
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(self.test_file),
                   "-k", self.selector]
        self.output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by `check`; not a pipe: unread ahead)
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self.output,
                                        stderr=subprocess.STDOUT, text=True)

    def check(self) -> None:
        self.start()
        ahead = _next(self)
        if ahead is not None:
            ahead.start()
        try:
            code = self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self.output.seek(0)
        text = self.output.read()
        self.output.close()
        assert code == 0, text[-9000:]
        assert " passed" in text and "skipped" not in text, text[-3000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_PLAN: list[Child] = []  # the parents' children in the session's order


def interpreted_in_child(selector: str, timeout: float = 600):
    """Make the decorated function (its body is not run) the parent test of its file's interpreted tests: it runs
    `pytest -k selector` on the file in a child process under the interpreter and fails unless that passed and
    skipped nothing. Skipped in a child itself."""
    def make(function):
        child = Child(inspect.getfile(function), selector, timeout)

        @functools.wraps(function)
        def parent() -> None:
            if INTERPRETED:
                pytest.skip("the parent of the interpreted tests (never spawns itself)")
            pytest.importorskip("triton")
            child.check()

        parent.interpreter_child = child
        return parent
    return make


def plan_children(items) -> None:
    """The collected parents' children, in order, leaving out parents skipped by a condition known now."""
    _PLAN[:] = [item.function.interpreter_child for item in items
                if getattr(getattr(item, "function", None), "interpreter_child", None) is not None
                and not any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))]


def _next(child: Child) -> Child | None:
    """The child after `child` in the plan, when it tests the same folder (so it overlaps only its siblings)."""
    if child not in _PLAN:
        return None
    index = _PLAN.index(child)
    ahead = _PLAN[index + 1] if index + 1 < len(_PLAN) else None
    return ahead if ahead is not None and ahead.test_file.parent == child.test_file.parent else None


def stop_children() -> None:
    for child in _PLAN:
        child.stop()
