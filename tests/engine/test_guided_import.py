"""A missing xgrammar and a broken one are told apart in the error a constrained request gets."""

import importlib.abc
import sys

import pytest

from hybridcache.guided import GuidedUnavailable, _xgrammar


class _BrokenXgrammar(importlib.abc.MetaPathFinder):
    """Finds `xgrammar`, whose import then fails on a missing dependency (as an install without its extras does)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "xgrammar":
            raise ImportError("No module named 'a_missing_dependency'", name="a_missing_dependency")
        return None


def test_a_missing_xgrammar_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    extra = r"needs the xgrammar package \(pip install 'hybridcache-llm\[guided\]'\)"
    with pytest.raises(GuidedUnavailable, match=extra):
        _xgrammar()


def test_a_broken_xgrammar_names_the_cause(monkeypatch):
    monkeypatch.delitem(sys.modules, "xgrammar", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenXgrammar(), *sys.meta_path])
    cause = "installed but fails to import: No module named 'a_missing_dependency'"
    with pytest.raises(GuidedUnavailable, match=cause):
        _xgrammar()
