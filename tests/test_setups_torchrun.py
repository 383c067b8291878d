"""tests/setups.run_torchrun: one more run after a child's C++ abort, none after any other failure."""

from __future__ import annotations

import os
import sys

import pytest
from setups import CXX_ABORT, run_torchrun

pytestmark = pytest.mark.timeout(60)

# Stands in for torchrun: fails on its first run (with the abort's text, or another error), succeeds on the next.
SCRIPT = """
import os, sys
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write(sys.argv[2] + "\\n")
    sys.exit(1)
os.makedirs(sys.argv[3], exist_ok=True)
print("second run")
"""


def test_a_cxx_abort_is_run_once_more_with_a_warning_after_cleaning(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "partial").write_text("from the aborted run")
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "marker"), CXX_ABORT, str(tmp_path / "out")]
    with pytest.warns(UserWarning, match="aborted .*running it once more"):
        done = run_torchrun(command, dict(os.environ), clean=[tmp_path / "out"])
    assert done.returncode == 0 and "second run" in done.stdout
    assert not (tmp_path / "out" / "partial").exists()  # cleaned before the second run


def test_any_other_failure_is_returned_as_it_is(tmp_path):
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "marker"), "RuntimeError: a real bug", str(tmp_path / "out")]
    done = run_torchrun(command, dict(os.environ))
    assert done.returncode == 1 and "a real bug" in done.stderr and not (tmp_path / "out").exists()
