"""Engine tests; `needs_xgrammar`, the marker of the structured-output cases."""

import importlib.util

import pytest

# structured output is the `guided` extra: without xgrammar (a device with only the base install) its tests skip
needs_xgrammar = pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar (guided)")
