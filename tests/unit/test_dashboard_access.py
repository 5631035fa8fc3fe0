"""Who may fetch the dashboard and what the page offers a key: its static files are open
(they hold no data), everything it reads keeps its own rule, and admin actions are offered
exactly to the keys the admin routes accept."""

from __future__ import annotations

from importlib.resources import files

import pytest

from loraserve.server.auth import check_access
from loraserve.server.dashboard import PATHS, STATIC
from loraserve.server.dashboard_routes import access
from loraserve.server.settings import ServerSettings

KEYS = ServerSettings(host="0.0.0.0", api_key="user", admin_api_key="admin")


def test_every_listed_file_ships_and_nothing_refers_to_another_host():
    folder = files("loraserve.server.dashboard")
    shipped = {p.name for p in folder.iterdir() if p.name.endswith((".html", ".js", ".css"))}
    assert shipped == set(STATIC)  # a file the page imports but the server does not serve: 404
    for name in STATIC:
        text = folder.joinpath(name).read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text and "//cdn" not in text, name


@pytest.mark.parametrize("path", sorted(PATHS))
def test_static_files_need_no_key(path):
    assert check_access(path, None, KEYS) is None


@pytest.mark.parametrize("path", ["/dashboard/access", "/dashboard/other.js", "/metrics",
                                  "/v1/models", "/dashboard/../metrics"])
def test_everything_else_keeps_its_key_check(path):
    assert check_access(path, None, KEYS)[0] == 401
    assert check_access(path, "user", KEYS) is None


@pytest.mark.parametrize("settings, token, expected", [
    (KEYS, "admin", {"operator": True, "adapter_updates": True}),
    (KEYS, "user", {"operator": False, "adapter_updates": False}),
    (KEYS, None, {"operator": False, "adapter_updates": False}),
    # loopback, no admin key: the machine's users are the operator; updates only if allowed
    (ServerSettings(), None, {"operator": True, "adapter_updates": False}),
    (ServerSettings(allow_runtime_lora_updates=True), None,
     {"operator": True, "adapter_updates": True}),
    (ServerSettings(host="0.0.0.0"), None, {"operator": False, "adapter_updates": False}),
])
def test_access_matches_what_the_admin_routes_accept(settings, token, expected):
    assert access(settings, token) == expected
    load_allowed = check_access("/v1/load_lora_adapter", token, settings) is None
    assert load_allowed == expected["adapter_updates"]
