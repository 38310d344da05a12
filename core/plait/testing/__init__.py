"""Helpers for testing plait and plait adapters: a multi-process launcher with a watchdog, and the adapter
conformance kit (``assert_conformance``; ``plait.testing.conformance`` for the modes and the table)."""

from plait.testing.launcher import WorkerFailure, launch


def __getattr__(name: str):
    # The kit imports pytest (for its fixture) and plait's model code: load it only when asked for.
    if name == "assert_conformance":
        from plait.testing.pytest_plugin import assert_conformance

        return assert_conformance
    raise AttributeError(f"module 'plait.testing' has no attribute {name!r}")


__all__ = ["WorkerFailure", "assert_conformance", "launch"]
