"""train_ft.py's refusals that need no Lighthouse and no launch (issue 39): a group number outside
--groups, a --min-groups no quorum could reach, and a start without torchrun, each one line and
status 2 before any process group."""
from __future__ import annotations

import pytest

from tests.conftest import refusal_in_process

pytestmark = pytest.mark.quick  # no launch: the quick tier (pytest -m quick)

GROUP = ["train_ft.py", "--dataset", "mnist", "--batch-size", "48", "--lighthouse", "http://h:1"]


@pytest.mark.parametrize("extra, says", [
    (["--groups", "2", "--group-id", "5"], "--group-id 5: the groups are numbered 0 to 1 (--groups 2)"),
    (["--groups", "2", "--group-id", "2"], "--group-id 2: the groups are numbered 0 to 1 (--groups 2)"),
    (["--groups", "2", "--group-id", "0", "--min-groups", "3"], "--min-groups 3 is more than --groups 2: no step"),
    (["--groups", "2", "--group-id", "1"], "train_ft.py runs each replica group as a torchrun job: launch/ft.sh"),
    (["--groups", "2", "--group-id", "0", "--ft-timeout-s", "inf"], "--quorum-timeout-s must be > 0 seconds, and fin"),
], ids=["group-id-beyond", "group-id-equal", "min-groups", "without-torchrun", "no-deadline"])
def test_train_ft_refuses_in_one_line_with_status_2(extra, says, capsys, monkeypatch):
    pytest.importorskip("torchft")
    for name in ("FT_GROUPS", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code, err = refusal_in_process([*GROUP, *extra], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and says in err and "Traceback" not in err, err
