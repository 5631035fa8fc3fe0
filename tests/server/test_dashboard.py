"""The dashboard in a real browser (headless Chromium driven by Playwright) against a real
server: the page lists the adapters with their tiers, follows loads and unloads made through
the API, streams two adapters and the base model side by side in the playground (the answers
the API gives), runs admin actions with the admin key, and shows a client key no admin
control; without /metrics it says so; a tenants panel appears when /metrics has tenants.

Debian's chromium is used as installed (`apt-get install chromium`); nothing is downloaded.
Screenshots go to the test's tmp folder.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from adapter_factory import make_peft_adapter
from server_utils import ServerProcess

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="the dev extra's playwright is not installed")
CHROMIUM = os.environ.get("LORASERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no chromium: `apt-get install chromium` (the CI script does, as root) to run "
                "the dashboard's browser test", allow_module_level=True)
expect = sync_api.expect

ADMIN, USER = "admin-secret", "user-secret"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SOON = 8000  # ms: the page polls every 2 s
LOAD_TIME = re.compile(r"^\d+ ms$|^\d+\.\d\d s$")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("dashboard")
    adapters = {name: make_peft_adapter(tiny_model_dir, root / name, seed=seed)
                for name, seed in (("sql", 21), ("chat", 22), ("extra", 23))}
    server = ServerProcess(tiny_model_dir, "--lora-paths", f"sql={adapters['sql']}",
                           f"chat={adapters['chat']}", "--admin-api-key", ADMIN,
                           "--api-key", USER, log_dir=root)
    try:
        yield server.wait_ready(), adapters, root
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, server, key: str | None):
    page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
    page.goto(f"{server.url}/dashboard")
    if key is not None:
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Use key").click()
    return page


def row(page, model: str):
    return page.locator(f'#models tbody tr[data-model="{model}"]')


def models(server) -> dict[str, dict]:
    r = server.get("/v1/models", key=ADMIN)
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


def test_page_lists_every_model_with_its_tier_and_live_charts(setup, browser):
    server, _, root = setup
    page = open_page(browser, server, ADMIN)
    expect(page.locator("#access")).to_have_text("admin")
    cards = models(server)
    assert set(cards) >= {"sql", "chat"}
    for model_id, card in cards.items():
        r = row(page, model_id)
        expect(r).to_be_visible(timeout=SOON)
        expect(r.locator(".col-tier")).to_have_text(card["tier"])
        expect(r.locator(".col-pinned")).to_have_text("pinned" if card["pinned"] else "—")
    expect(row(page, "sql").locator(".col-version")).to_have_text("v1")
    path = row(page, "sql").locator(".col-path")  # the operator's: where the weights are
    expect(path).to_have_attribute("title", cards["sql"]["root"])
    assert cards["sql"]["root"].endswith(path.text_content().lstrip("…"))
    # read at start-up: its load time is in /metrics, and on the page
    expect(row(page, "sql").locator(".col-load")).to_have_text(LOAD_TIME)
    expect(page.locator("#charts figure")).to_have_count(5)
    expect(page.locator("#metrics-note")).to_be_hidden()
    expect(page.locator("#tenants")).to_be_hidden()  # no keys file: no tenant series
    # a second scrape gives the rates: the throughput chart draws a line
    expect(page.locator("#charts figure").nth(0).locator("path")).to_have_count(1,
                                                                                 timeout=SOON)
    page.screenshot(path=str(root / "dashboard-models.png"), full_page=True)


def test_loads_and_unloads_through_the_api_show_within_seconds(setup, browser):
    server, adapters, _ = setup
    page = open_page(browser, server, ADMIN)
    expect(row(page, "sql")).to_be_visible(timeout=SOON)
    expect(row(page, "extra")).to_have_count(0)
    r = server.post("/v1/load_lora_adapter", {"lora_name": "extra",
                                              "lora_path": str(adapters["extra"])}, key=ADMIN)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    expect(row(page, "extra")).to_be_visible(timeout=SOON)
    expect(row(page, "extra").locator(".col-tier")).to_have_text(models(server)["extra"]["tier"])
    # loaded through the API: its load time is in /metrics, and on the page
    expect(row(page, "extra").locator(".col-load")).to_have_text(LOAD_TIME)
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "extra"}, key=ADMIN)
    assert r.status_code == 200, r.text
    expect(row(page, "extra")).to_have_count(0, timeout=SOON)
    assert time.monotonic() - t0 < 20


def test_admin_loads_pins_replaces_and_unloads_from_the_page(setup, browser):
    server, adapters, root = setup
    page = open_page(browser, server, ADMIN)
    form = page.locator("#load-form")
    expect(form).to_be_visible()
    form.get_by_label("name").fill("extra")
    form.get_by_label("path").fill(str(adapters["extra"]))
    form.get_by_role("button", name="Load").click()
    expect(row(page, "extra")).to_be_visible(timeout=SOON)
    first = models(server)["extra"]
    assert first["pinned"] is False
    page.get_by_role("button", name="Pin extra").click()
    expect(row(page, "extra").locator(".col-pinned")).to_have_text("pinned", timeout=SOON)
    assert models(server)["extra"]["pinned"] is True
    # Replace…: the form is filled with the name and `replace`, the path is the user's
    page.get_by_role("button", name="Replace extra with new weights").click()
    expect(form.get_by_label("path")).to_be_focused()
    form.get_by_label("path").fill(str(adapters["sql"]))
    form.get_by_role("button", name="Load").click()
    # versions of a name are numbered for good: a new one is the next number
    replaced = first["version"] + 1
    expect(row(page, "extra").locator(".col-version")).to_contain_text(f"v{replaced}",
                                                                       timeout=SOON)
    assert models(server)["extra"]["version"] == replaced
    page.get_by_role("button", name="Unload extra", exact=True).click()
    expect(row(page, "extra")).to_have_count(0, timeout=SOON)
    assert not any(m.startswith("extra") for m in models(server))
    # a refused action says why, and changes nothing
    form.get_by_label("name").fill("bad")
    form.get_by_label("path").fill(str(root / "missing"))
    form.get_by_role("button", name="Load").click()
    expect(page.locator("#action-status")).to_contain_text("failed", timeout=SOON)
    assert "bad" not in models(server)


def completion(server, model: str, prompt: str, n: int) -> str:
    r = server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                        "temperature": 0}, key=USER)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_playground_streams_adapters_side_by_side_and_diffs_them(setup, browser):
    server, _, root = setup
    page = open_page(browser, server, USER)
    base = next(c for c in models(server).values() if c["parent"] is None)["id"]
    play = page.locator("#playground")
    expect(play.locator("#play-models input")).to_have_count(len(models(server)), timeout=SOON)
    for model_id in (base, "sql", "chat"):
        play.get_by_role("checkbox", name=model_id, exact=True).check()
    play.get_by_role("radio", name="completion").check()
    prompt = "the cat reads a table"
    play.get_by_label("Prompt").fill(prompt)
    play.get_by_label("max_tokens").fill("24")
    play.get_by_label("temperature").fill("0")
    streams = []  # what the page sent, and the type of what came back
    page.on("response", lambda r: streams.append((r.request.post_data_json,
                                                  r.headers.get("content-type", "")))
            if r.url.endswith("/v1/completions") else None)
    play.get_by_role("button", name="Run").click()
    outputs = page.locator("#outputs .output")
    expect(outputs).to_have_count(3)
    expect(page.locator("#outputs .output.done")).to_have_count(3, timeout=30000)
    boxes = [outputs.nth(i).bounding_box() for i in range(3)]
    assert boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"]  # side by side
    assert abs(boxes[0]["y"] - boxes[2]["y"]) < 1
    for i, model_id in enumerate((base, "sql", "chat")):
        panel = outputs.nth(i)
        expect(panel.locator("h3")).to_have_text(model_id)
        streamed = panel.locator(".text").text_content()
        assert streamed == completion(server, model_id, prompt, 24), model_id
    # one server-sent event stream per model
    assert sorted(body["model"] for body, _ in streams) == sorted((base, "sql", "chat"))
    for body, content_type in streams:
        assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 24
        assert content_type.startswith("text/event-stream")
    assert outputs.nth(1).locator(".text").text_content() != \
        outputs.nth(2).locator(".text").text_content()
    diff = page.locator("#diff")
    expect(diff.locator(".diff-pair")).to_have_count(2)
    expect(diff.locator("h3")).to_contain_text(f"against {base}")
    assert diff.locator("ins, del").count() > 0  # the adapters change the base's answer
    page.screenshot(path=str(root / "dashboard-playground.png"), full_page=True)


def test_a_client_key_sees_no_admin_control_and_no_path(setup, browser):
    server, _, root = setup
    page = open_page(browser, server, USER)
    expect(page.locator("#access")).to_have_text("client")
    expect(row(page, "sql")).to_be_visible(timeout=SOON)
    expect(page.locator("#load-form")).to_be_hidden()
    expect(page.get_by_role("button", name="Unload")).to_have_count(0)
    expect(page.get_by_role("button", name="Pin")).to_have_count(0)
    expect(page.locator("#models .col-path").first).to_be_hidden()
    assert str(root) not in page.content()
    # no key at all: the page asks for one instead of failing
    page = open_page(browser, server, None)
    expect(page.locator("#models-error")).to_contain_text("needs an API key", timeout=SOON)
    expect(page.locator("#load-form")).to_be_hidden()


def test_refused_metrics_degrade_and_tenant_series_make_a_panel(setup, browser):
    server, _, root = setup
    ctx = browser.new_context()
    ctx.route("**/metrics", lambda route: route.fulfill(
        status=403, content_type="application/json",
        body='{"error": {"message": "operator only", "type": "x", "code": "forbidden"}}'))
    page = ctx.new_page()
    page.goto(f"{server.url}/dashboard")
    page.get_by_label("API key").fill(USER)
    page.get_by_role("button", name="Use key").click()
    expect(page.locator("#metrics-note")).to_contain_text("Metrics need the admin key",
                                                          timeout=SOON)
    expect(row(page, "sql")).to_be_visible()  # the rest still works
    ctx.close()

    tenants = ('loraserve_tenant_limit{tenant="acme",limit="max_concurrency"} 4\n'
               'loraserve_tenant_requests_in_flight{tenant="acme"} 2\n'
               'loraserve_tenant_requests_total{tenant="acme"} 17\n'
               'loraserve_tenant_requests_total{tenant="globex"} 3\n'
               'loraserve_tenant_rate_limited_total{tenant="globex"} 1\n')

    def with_tenants(route):
        real = httpx.get(server.url + "/metrics", headers=server.headers(ADMIN)).text
        route.fulfill(status=200, content_type="text/plain", body=real + tenants)

    ctx = browser.new_context(viewport={"width": 1440, "height": 900})
    ctx.route("**/metrics", with_tenants)
    page = ctx.new_page()
    page.goto(f"{server.url}/dashboard")
    page.get_by_label("API key").fill(ADMIN)
    page.get_by_role("button", name="Use key").click()
    panel = page.locator("#tenants")
    expect(panel).to_be_visible(timeout=SOON)
    expect(panel.locator("tbody tr")).to_have_count(2)
    expect(panel.locator("thead")).to_contain_text("limit: max concurrency")
    acme = panel.locator("tbody tr").nth(0)
    expect(acme).to_contain_text("acme")
    expect(acme).to_contain_text("17")
    page.screenshot(path=str(root / "dashboard-tenants.png"), full_page=True)
    ctx.close()


def test_the_pages_parser_and_diff_agree_with_references(setup, browser):
    """The page's Prometheus parser reads the server's /metrics as prometheus_client's own
    parser does; its word diff rebuilds both texts and keeps the common words."""
    from prometheus_client.parser import text_string_to_metric_families

    server, _, _ = setup
    server.post("/v1/completions", {"model": "sql", "prompt": "hello", "max_tokens": 4},
                key=USER)
    text = server.get("/metrics", key=ADMIN).text + 'x_total{a="q\\"uo\\\\te\\n"} +Inf\n'
    page = open_page(browser, server, None)
    got = page.evaluate("""async ([text, pairs]) => {
        const { parsePrometheus } = await import('/dashboard/prom.js');
        const { wordDiff } = await import('/dashboard/diff.js');
        const samples = parsePrometheus(text).samples.map(
            (s) => [s.name, s.labels, Number.isFinite(s.value) ? s.value : String(s.value)]);
        return { samples, diffs: pairs.map(([a, b]) => wordDiff(a, b)) };
    }""", [text, [["the cat sat on the mat", "the dog sat on a mat"], ["", "new words"],
                  ["same  text\\n", "same  text\\n"]]])
    def canon(name, labels, value):
        return name, sorted(labels.items()), value if isinstance(value, str) else float(value)

    ref = [canon(s.name, s.labels, s.value if s.value != float("inf") else "Infinity")
           for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert len(ref) > 50
    assert sorted(map(repr, (canon(*s) for s in got["samples"]))) == sorted(map(repr, ref))
    assert got["diffs"][0] == [
        {"op": "same", "text": "the "}, {"op": "del", "text": "cat "},
        {"op": "add", "text": "dog "}, {"op": "same", "text": "sat on "},
        {"op": "del", "text": "the "}, {"op": "add", "text": "a "},
        {"op": "same", "text": "mat"}]
    assert got["diffs"][1] == [{"op": "add", "text": "new words"}]
    assert got["diffs"][2] == [{"op": "same", "text": "same  text\\n"}]
