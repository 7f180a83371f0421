"""Engine tests; `needs_xgrammar`, the marker of the structured-output cases."""

import pytest

from hybridcache.guided import GuidedUnavailable, _xgrammar


def _xgrammar_imports() -> bool:
    try:
        _xgrammar()
    except GuidedUnavailable:
        return False
    return True


# structured output is the `guided` extra: without an importable xgrammar (a device with only the base install, or
# one whose xgrammar lacks a dependency) its tests skip
needs_xgrammar = pytest.mark.skipif(not _xgrammar_imports(), reason="needs an importable xgrammar (guided)")
