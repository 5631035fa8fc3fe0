"""Take docs/dashboard.png: what `make serve` shows at /dashboard after a little traffic, with
the playground comparing the base model and two demo adapters (headless Debian chromium).

    .venv/bin/python tools/dashboard_screenshot.py [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from server_utils import free_port  # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def traffic(url: str, stop: threading.Event) -> None:
    """Chat requests over the demo adapters, a few at a time, until stopped."""
    models = ["pirate", "shouty", "french", None]
    i = 0
    while not stop.is_set():
        threads = []
        for k in range(3):
            model = models[(i + k) % len(models)]
            body = {"messages": [{"role": "user", "content": f"Tell me about city {i + k}."}],
                    "max_tokens": 24, "temperature": 0.7}
            if model:
                body["model"] = model
            threads.append(threading.Thread(target=httpx.post, daemon=True, kwargs=dict(
                url=url + "/v1/chat/completions", json=body, timeout=120)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        i += 3


def main() -> None:
    from playwright.sync_api import expect, sync_playwright

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "docs" / "dashboard.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "loraserve.demo", "serve", "--port",
                               str(port), "--allow-runtime-lora-updates"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    stop = threading.Event()
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url + "/dashboard")
            feeder = threading.Thread(target=traffic, args=(url, stop), daemon=True)
            feeder.start()
            time.sleep(50)  # the charts fill in
            stop.set()
            feeder.join()
            play = page.locator("#playground")
            ids = [c["id"] for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
            expect(play.locator("#play-models input")).to_have_count(len(ids))
            for model in ids:  # the base model (listed first) and two adapters
                play.get_by_role("checkbox", name=model, exact=True).set_checked(
                    model in (ids[0], "pirate", "french"))
            play.get_by_label("Prompt").fill("What is the capital of Spain?")
            play.get_by_label("max_tokens").fill("40")
            play.get_by_role("button", name="Run").click()
            expect(page.locator("#outputs .output.done")).to_have_count(3, timeout=120000)
            time.sleep(2.5)  # one more poll: the table counts the playground's tokens
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        stop.set()
        server.terminate()
        server.wait(30)
    print(args.out)


if __name__ == "__main__":
    main()
