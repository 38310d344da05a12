"""The adapter's whole parity suite: every mode the installed plait can run, against one process."""

from plait.testing import assert_conformance


def test_conformance():
    assert_conformance("opt")
