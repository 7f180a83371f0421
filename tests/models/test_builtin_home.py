"""Where the built-in model is written: $HYBRIDCACHE_HOME, else $XDG_CACHE_HOME/hybridcache (it ignored XDG, which
huggingface_hub and vLLM honour), else ~/.cache/hybridcache; a folder it cannot write (a container's read-only
HOME) is an OSError that names the variables to set (it named only the path; hunt 196)."""

from __future__ import annotations

import pytest

from hybridcache.models import builtin


def test_the_built_in_model_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtin.builtin_model_dir().parent == tmp_path / "xdg" / "hybridcache"
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(tmp_path / "own"))
    assert builtin.builtin_model_dir().parent == tmp_path / "own"
    monkeypatch.delenv("HYBRIDCACHE_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builtin.builtin_model_dir().parent == tmp_path / "home" / ".cache" / "hybridcache"


def test_an_unwritable_home_names_the_variables_to_set(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"  # a folder cannot be made under a file, whoever runs this (root too)
    blocker.write_text("")
    monkeypatch.setenv("HYBRIDCACHE_HOME", str(blocker / "sub"))
    with pytest.raises(OSError, match="set HYBRIDCACHE_HOME or XDG_CACHE_HOME to a writable folder"):
        builtin.ensure_builtin_model()
