"""The cluster modules share one Ray instance (cluster_utils.LocalCluster): it goes once the
last test of this folder is done, not at the end of the whole run, where it would hold its
processes and memory beside every test after it."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(trylast=True)  # after the module fixtures' teardown has deleted their apps
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or Path(nextitem.path).parent != HERE:
        from cluster_utils import stop_ray

        stop_ray()
