"""pytest-xdist's `--dist loadfile` as this suite runs it (scripts/test.sh: `pytest -n 2 --dist loadfile`).

Each file's tests run on one worker, as in xdist, except the Triton-interpreter parents of tests/kernels/interpreter.py:
a folder's parents are one work unit of their own, so one worker runs them all and their folder's batch of
interpreted tests runs once, in one child. These units go first: the child computes on one core (its worker waits
for it) while the other worker runs the files. The controller sees node ids only, so a parent is known by its name
(the test function's name holds "interpreter" and ends with "subprocess"; `plan_children` refuses a parent named
otherwise under this scheduling). Installed by `pytest_xdist_make_scheduler` in tests/conftest.py, which also tells
the workers (`workerinput[PARENTS_TOGETHER]`)."""

from __future__ import annotations

import re

from xdist.scheduler import LoadFileScheduling

PARENTS_TOGETHER = "hybridcache_interpreter_parents_together"  # the workers' flag: True under this scheduling
PARENT_NAME = re.compile(r"test_\w*interpreter\w*subprocess")
PARENTS_UNIT = " interpreter parents"  # the end of a parents unit's key


def parents_unit(nodeid: str) -> str | None:
    """The work unit of an interpreter parent's node id ("<folder> interpreter parents"), None for other tests."""
    path, _, name = nodeid.rpartition("::")
    if not PARENT_NAME.fullmatch(name):
        return None
    return path.split("::", 1)[0].rpartition("/")[0] + PARENTS_UNIT


class LoadFileParentsScheduling(LoadFileScheduling):
    """xdist's loadfile scheduling, with each folder's interpreter parents as one more work unit."""

    def _split_scope(self, nodeid: str) -> str:
        return parents_unit(nodeid) or super()._split_scope(nodeid)

    def _assign_work_unit(self, node) -> None:
        """Send the parents units, the biggest first, before the files (xdist sends the biggest units first)."""
        units = sorted((scope for scope in self.workqueue if scope.endswith(PARENTS_UNIT)),
                       key=lambda scope: len(self.workqueue[scope]))
        for scope in units:  # the last one moved, the biggest, goes first
            self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
