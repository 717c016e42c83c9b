"""Hooks kimi-perf calls, for conftest files and other plugins (pytest-benchmark's pattern).

Registered by the plugin with ``pluginmanager.add_hookspecs``; implement them in a ``conftest.py``.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec(firstresult=False)
def pytest_perf_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add or change fields of the machine info written to the run file (e.g. a runner's pool name)."""


@pytest.hookspec(firstresult=False)
def pytest_perf_result(config: pytest.Config, result: dict[str, Any]) -> None:
    """Called on the controlling process for every recorded result (after gating), e.g. to push it to a
    dashboard. ``result`` is the JSON-ready record that also goes into the run file."""
