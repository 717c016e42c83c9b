"""The controller-side result collector: report transport, run file, history, baseline update, summary.

Split out of :mod:`kimi_perf.plugin`: what happens to the recorded results after the tests (on the
xdist controller, from ``report.user_properties``) is independent of how a test records them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .baselines import BaselineError, entries_from_results
from .machine import commit_info, machine_info
from .recorder import PROP
from .session import SESSION_KEY, PerfSession, activate, end_session_on_signals


class PerfCollector:
    """Registered on the controlling process only: turns reports into the summary, run file and
    baseline update. (On an xdist worker ``report.user_properties`` travel to the controller.)

    Registered before the session exists: the xdist controller collects nothing, so it builds the
    session from the first result a worker reports; a run without results never builds it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.updated: tuple[Path, int] | None = None
        # why --perf-update-baselines wrote nothing at the end (said in the summary, the run fails)
        self.update_error: str | None = None

    @property
    def s(self) -> PerfSession:
        return activate(self.config)

    def _active(self) -> bool:
        return self.config.stash.get(SESSION_KEY, None) is not None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        cfg = self.config
        for name, value in report.user_properties:
            if name == PROP:
                rec: dict[str, Any] = json.loads(value) if isinstance(value, str) else dict(value)  # type: ignore[call-overload]
                rec["outcome"] = report.outcome
                self.s.results.append(rec)
                end_session_on_signals(cfg)  # the xdist controller collects nothing: its first sign of a run
                cfg.hook.pytest_perf_result(config=cfg, result=rec)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self._active():
            return
        s = self.s
        if not s.results:
            return
        from .report import write_reports

        minfo = machine_info(with_torch=False)
        session.config.hook.pytest_perf_update_machine_info(config=session.config, machine_info=minfo)
        commit = commit_info(s.rootdir)
        write_reports(s, minfo, commit)
        if s.history_path is not None:
            from .history import append_history, history_lines

            append_history(s.history_path, history_lines(s.results, profile=s.profile.name, hardware=s.hardware,
                                                         commit=commit, machine=minfo))
        if not s.update:
            return
        entries = entries_from_results(s.results, commit=commit, machine=minfo)
        if entries:
            try:
                self.updated = (s.store.write(entries), len(entries))
            except (OSError, BaselineError) as e:
                # the directory was checked up front; a disk that filled or a file that changed under
                # the run still must not cost the summary: say it there and fail the run
                self.update_error = f"{type(e).__name__}: {e}"
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if not self._active():
            return
        s = self.s
        if not s.results:
            return
        from .report import AB_HEADERS, ab_detail_lines, ab_rows, summary_rows, text_table

        tr = terminalreporter
        tr.write_sep("=", f"kimi-perf summary: profile {s.profile.name}, hardware {s.hardware}, repeats {s.repeats}")
        rows, abr = summary_rows(s.results), ab_rows(s.results)
        if rows or not abr:
            for line in text_table(rows).splitlines():
                tr.write_line(line)
        if abr:
            tr.write_sep("-", "same-run A/B: candidate vs base, interleaved in this job")
            for line in [*text_table(abr, AB_HEADERS).splitlines(), *ab_detail_lines(s.results)]:
                tr.write_line(line)
        tr.write_line(f"report: {s.report_dir / 'summary.md'}  run file: {s.report_dir / 'run.json'}")
        if self.updated:
            tr.write_line(f"baselines updated: {self.updated[0]} ({self.updated[1]} entries)")
            for c in s.store.conflicts:
                tr.write_line(f"baselines: CONFLICTING UPDATE {c}")
        if self.update_error:
            tr.write_line(f"baselines NOT updated ({s.store.path}): {self.update_error}", red=True)
