"""The suite needs the native library: `$ASCEND_MOE_LIB` or the one inside the installed package."""

import pytest

import ascend_moe


def pytest_configure(config):
    try:
        ascend_moe.library_path()
    except OSError as e:
        raise pytest.UsageError(str(e))
