"""``conftest.require_module``: a pinned package that does not import skips its test locally and
fails it under CI (``CI`` set), where it means a broken install."""

from __future__ import annotations

import pytest
from conftest import require_module


def test_a_pinned_module_that_does_not_import_skips_locally_and_fails_under_ci(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert require_module("json").__name__ == "json"
    for ci, outcome, message in ((None, pytest.skip.Exception, "no_such_pinned_module does not import"),
                                 ("true", pytest.fail.Exception, "CI must install no_such_pinned_module")):
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        with pytest.raises(BaseException) as raised:  # a skip or a failure: caught, so this test can fail on it
            require_module("no_such_pinned_module")
        assert raised.type is outcome and message in str(raised.value), (ci, raised)
