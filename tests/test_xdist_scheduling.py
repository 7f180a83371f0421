"""tests/xdist_scheduling.py's work units (scripts/test.sh runs the suite with `-n 2 --dist loadfile`)."""

import re
from pathlib import Path

import pytest

pytest.importorskip("xdist")

from tests.xdist_scheduling import LoadFileParentsScheduling, parents_unit  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_a_folders_interpreter_parents_are_one_unit_and_other_tests_go_by_file():
    unit = "tests/kernels interpreter parents"
    assert parents_unit("tests/kernels/test_write_kv.py::test_triton_interpreter_in_subprocess") == unit
    assert parents_unit("tests/kernels/test_mamba1_cuda.py::test_triton_scan_in_an_interpreter_subprocess") == unit
    assert parents_unit("tests/engine/test_paged_state.py::test_triton_interpreter_in_subprocess") == (
        "tests/engine interpreter parents")
    for other in ("tests/kernels/test_write_kv.py::test_interpreted_write_kv[fp8]",
                  "tests/kernels/test_write_kv.py::test_triton_interpreter_in_subprocess[x]",
                  "tests/cache/test_admission.py::test_admits"):
        assert parents_unit(other) is None
    scheduling = LoadFileParentsScheduling.__new__(LoadFileParentsScheduling)  # (_split_scope reads no state)
    assert scheduling._split_scope("tests/kernels/test_qkv_prep.py::test_interpreter_in_subprocess") == unit
    assert scheduling._split_scope("tests/kernels/test_qkv.py::TestX::test_bad") == "tests/kernels/test_qkv.py"


def test_every_interpreter_parent_is_named_as_the_scheduler_finds_it():
    """The controller knows a parent by its name only: a parent named otherwise would run beside its folder's batch
    on another worker (and fails there, saying so); this finds it in a run without xdist too."""
    parents = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for name in re.findall(r"^@interpreted_in_child\(.*\n(?:@.*\n)*def (\w+)", path.read_text(), re.MULTILINE):
            parents.append(f"{path.relative_to(TESTS.parent).as_posix()}::{name}")
    assert len(parents) >= 20, parents  # (the kernel files' and tests/engine/test_paged_state.py's)
    assert [nodeid for nodeid in parents if parents_unit(nodeid) is None] == []
