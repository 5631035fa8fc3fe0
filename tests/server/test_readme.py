"""The README works as written: its own shell commands and Python snippet run, the
bench and curl ones against the server `make serve` starts; its flag table matches the parser;
it links nothing outside the repository.

Commands are taken from the README's code blocks, not copied here; only its placeholders
(/path/to/peft_dir, MODEL_DIR, port 8000, the request counts) are filled in.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_utils import REPO, free_port

README = (REPO / "README.md").read_text()
DEMO_ADAPTER = REPO / "loraserve" / "demo" / "data" / "pirate"
BIN = Path(sys.executable).parent


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def shell_commands() -> list[str]:
    """Every command of the README's bash blocks, continuation lines joined."""
    cmds = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                cmds.append(shlex.join(words))
    return cmds


def fill(cmd: str, port: int, tmp: Path, model_dir: Path) -> list[str]:
    for old, new in {"/path/to/peft_dir": str(DEMO_ADAPTER), "localhost:8000": f"localhost:{port}",
                     "127.0.0.1:8000": f"127.0.0.1:{port}", "MODEL_DIR": str(model_dir),
                     "/tmp/loras": str(tmp / "loras"), "--num 32": "--num 2",
                     "--num-requests 60": "--num-requests 6"}.items():
        cmd = cmd.replace(old, new)
    words = shlex.split(cmd)
    if words[0].startswith(".venv/bin/"):  # the venv the tests run in
        words[0] = str(BIN / Path(words[0]).name)
    return words


def run(words: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, f"{shlex.join(words)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


class Background:
    """A long-running README command (its own process group, so `make`'s child goes too)."""

    def __init__(self, words: list[str], port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(words, cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> Background:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text(errors="replace"))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """`sig` to the whole group (SIGINT: what Ctrl-C in a terminal sends), SIGKILL after
        30 s. The cluster command's group holds Ray's own processes too: SIGTERM to all of them
        at once ends them under the command, whose shutdown then waits on them, while on
        Ctrl-C it shuts them down itself."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


def test_readme_starts_with_the_two_commands():
    first = shell_commands()[:2]
    assert first == ["make serve", "make test"]
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1].strip() == "make test"


def test_readme_links_stay_inside_the_repository():
    for target in re.findall(r"\]\(([^)]+)\)", README):
        assert not target.startswith(("../", "/")), target
        if not target.startswith(("http://", "https://", "#")):
            assert (REPO / target.split("#")[0]).exists(), target
    assert "../shared" not in README


def test_readme_flag_table_matches_the_parser():
    from loraserve.readme_flags import readme_table, render_flags_table

    assert readme_table(README) == render_flags_table(), \
        "stale: run python -m loraserve.readme_flags"
    from loraserve.readme_flags import serve_parser

    for action in serve_parser()._actions:  # every flag says what it does
        assert action.help, action.option_strings


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    """`make serve ARGS="..."` exactly as the README says, on a free port."""
    port = free_port()
    log = tmp_path_factory.mktemp("readme") / "make-serve.log"
    server = Background(["make", "-s", "serve",
                         f"ARGS=--allow-runtime-lora-updates --port {port}"], port, log)
    try:
        yield server.wait_ready(), port
    finally:
        assert server.stop() in (0, -signal.SIGTERM, 2), server.log.read_text(errors="replace")


def test_make_serve_says_what_it_loads_and_prints_its_examples_once_it_listens(make_serve):
    server, port = make_serve
    log = server.log.read_text(errors="replace")
    steps = ["finding the model", "loading ", "Uvicorn running on", "ready: serving",
             f"curl -s http://127.0.0.1:{port}/v1/models"]
    at = [log.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), (dict(zip(steps, at, strict=True)), log[-3000:])
    assert log.count(f"curl -s http://127.0.0.1:{port}/v1/models") == 1, log[-3000:]


def test_readme_commands_work_against_make_serve(make_serve, bundled_model_dir, tmp_path):
    server, port = make_serve
    ran = []
    for cmd in shell_commands()[2:]:
        words = fill(cmd, port, tmp_path, bundled_model_dir)
        name = Path(words[0]).name
        if name == "loraserve" and words[1] == "serve":
            # a second server, as written (plus a free port): up, serving the named adapter
            other = free_port()
            srv = Background([*words, "--port", str(other)], other, tmp_path / "serve.log")
            try:
                srv.wait_ready()
                models = httpx.get(srv.url + "/v1/models", timeout=10).json()
                assert "sql" in [m["id"] for m in models["data"]]
            finally:
                code = srv.stop(signal.SIGINT)
            assert code == 0, srv.log.read_text(errors="replace")[-3000:]  # Ctrl-C: a clean exit
        elif name == "curl":
            body = json.loads(run(words, timeout=60))
            assert "error" not in body, body
        elif name == "loraserve" and words[1] == "bench":
            out = run(words)
            assert re.search(r"requests: 6\s+completed: 6\s+errors: 0", out), out
        else:
            out = run(words)
            if "--version" in words:
                assert out.startswith("loraserve "), out
            elif words[1] == "generate":
                assert out.strip(), "generate printed nothing"
            elif "make_adapters" in cmd:
                assert sorted(p.name for p in (tmp_path / "loras").iterdir()) == ["lora0", "lora1"]
        ran.append(words[1] if name in ("loraserve", "python") else name)
    # every command family of the README ran: nothing was skipped by the parsing above
    assert {"generate", "serve", "bench", "--version", "-m", "curl"} <= set(ran), ran
    run([str(BIN / "python"), "-m", "loraserve", "--version"])  # "also: python -m loraserve"
    # the server kept serving through all of it
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


SERVER_URL = "http://127.0.0.1:8000"


def test_readme_python_snippets_run(tmp_path):
    """The offline snippets (those that need no server)."""
    snippets = [b for b in code_blocks("python") if SERVER_URL not in b]
    assert len(snippets) >= 2
    for i, snippet in enumerate(snippets):
        script = tmp_path / f"snippet{i}.py"
        script.write_text(snippet.replace("/path/to/peft_dir", str(DEMO_ADAPTER)))
        out = run([sys.executable, str(script)])
        assert out.strip(), f"snippet {i} printed nothing"


def test_readme_client_snippets_run_against_make_serve(make_serve, tmp_path):
    """The snippets that talk to a server, with the adapter they sample from loaded."""
    server, port = make_serve
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "policy", "lora_path": str(DEMO_ADAPTER), "replace": True})
    assert r.status_code == 200, r.text
    snippets = [b for b in code_blocks("python") if SERVER_URL in b]
    assert snippets
    for i, snippet in enumerate(snippets):
        script = tmp_path / f"client{i}.py"
        script.write_text(snippet.replace(SERVER_URL, server.url))
        out = run([sys.executable, str(script)])
        # the newest version (just loaded) sampled it
        assert out.startswith(f"policy@{r.json()['version']} "), out
