"""A pytest plugin that writes a run's results as they come, for a run that may be killed
before its summary (``bench/gpu-check.sh``'s tests stage): ``conftest.py`` registers
:class:`Reporter` where ``HBK_TEST_REPORT_DIR`` names a directory. There it keeps

* ``tally.json``: ``{"selected", "passed", "failed", "errors", "skipped"}``, rewritten
  (atomically) after every test;
* ``failures.txt``: for every failed test and every error, ``FAILED <id>`` or
  ``ERROR (at <phase>) <id>`` and its report, cut to its first :data:`HEAD_LINES` and
  last :data:`TAIL_LINES` lines (where the error is), appended as it happens.

Under pytest-xdist it runs in the controller, which sees every worker's reports.
"""
import json
import os

import pytest

HEAD_LINES, TAIL_LINES = 10, 15


class Reporter:
    def __init__(self, directory):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.tally = {"selected": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        open(os.path.join(directory, "failures.txt"), "w").close()
        self._write()

    def _write(self):
        path = os.path.join(self.directory, "tally.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.tally, f)
        os.replace(path + ".tmp", path)

    def pytest_collection_finish(self, session):
        if session.items:
            self.tally["selected"] = len(session.items)
            self._write()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.tally["selected"] = max(self.tally["selected"], len(ids))
        self._write()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome == "skipped":
            outcome = {"passed": "passed", "failed": "failed", "skipped": "skipped"}[report.outcome]
        elif report.failed:  # setup or teardown
            outcome = "errors"
        else:
            return
        self.tally[outcome] += 1
        self._write()
        if outcome in ("failed", "errors"):
            lines = (report.longreprtext or "").splitlines()
            if len(lines) > HEAD_LINES + TAIL_LINES:
                lines = lines[:HEAD_LINES] + ["..."] + lines[-TAIL_LINES:]
            head = "FAILED" if outcome == "failed" else f"ERROR (at {report.when})"
            with open(os.path.join(self.directory, "failures.txt"), "a") as f:
                f.write(f"{head} {report.nodeid}\n" + "".join(f"    {x}\n" for x in lines) + "\n")
