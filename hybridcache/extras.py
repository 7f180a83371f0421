"""The optional dependency groups ("extras") of the `hybridcache-llm` distribution, and a clear error when a
command needs one that is not installed."""

from __future__ import annotations

from importlib.util import find_spec

DISTRIBUTION = "hybridcache-llm"  # "hybridcache" on the package index is an unrelated project
EXTRAS = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "bench": ("matplotlib",),
    "guided": ("xgrammar",),
    "ray": ("ray", "fastapi", "uvicorn", "prometheus_client"),
}


class MissingExtra(ImportError):
    """A command needs modules of an extra that is not installed; the message says what to install."""


def require_extra(extra: str, what: str) -> None:
    """Raise MissingExtra naming `pip install 'hybridcache-llm[<extra>]'` when a module of `extra` is missing;
    `what` is what needs it (e.g. "hybridcache serve")."""
    missing = [module for module in EXTRAS[extra] if find_spec(module) is None]
    if missing:
        raise MissingExtra(f"{what} needs {', '.join(missing)} (the '{extra}' extra), which is not installed: "
                           f"pip install '{DISTRIBUTION}[{extra}]'")
