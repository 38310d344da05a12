"""Helpers for testing plait and plait adapters: a multi-process launcher with a watchdog."""

from plait.testing.launcher import WorkerFailure, launch

__all__ = ["WorkerFailure", "launch"]
