"""The soak's traffic (benchmarks/soak.py): clients, hang-ups, malformed requests, and the side
task that loads, unloads and reloads adapters. Speaks HTTP only.

Every answer is recorded; a completed greedy answer keeps (adapter name, prompt, max_tokens,
text, send/finish times) so the driver can recompute it offline for the weights it ran on.
Which weights those were is known from the side task's log of every change of a name's
weights: the versions registered at some moment between send and finish are the candidates.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Write a haiku about the sea.", "What is 17 times 23?", "Name three primary colors.",
    "Translate 'good morning' into French.", "Give one tip for learning to code.",
    "What is the capital of Japan?", "Describe a cat in one sentence.",
    "List two uses of a paperclip.", "Why is the sky blue?", "Say hello in Spanish.",
    "What does CPU stand for?", "Suggest a name for a bakery.",
]

# Each is a documented 4xx: broken JSON, wrong types, out-of-range values, unknown model.
MALFORMED = [
    b"{not json", b"[]", b'{"prompt": 5}', b'{"model": "nope-404", "prompt": "hi"}',
    b'{"prompt": "hi", "max_tokens": -3}', b'{"prompt": "hi", "n": 100000}',
    b'{"prompt": "hi", "temperature": "hot"}', b'{"prompt": ""}',
    b'{"messages": []}', b'{"prompt": "hi", "tools": [{"x": 1}]}',
    b'{"prompt": [999999999]}', b'{"prompt": "hi", "stop": ["", ""]}',
]


@dataclass
class Record:
    adapter: str | None
    prompt: int
    max_tokens: int
    text: str
    sent: float
    done: float


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    faults: Counter = field(default_factory=Counter)  # injected faults by kind
    bad_errors: list = field(default_factory=list)  # 4xx bodies that are not OpenAI-shaped
    records: list[Record] = field(default_factory=list)
    versions: dict = field(default_factory=dict)  # name -> [(since, path or None)]

    def status(self, kind: str, code: int, body: bytes = b"") -> None:
        self.statuses[(kind, code)] += 1
        if code >= 400:
            try:
                err = json.loads(body)["error"]
                assert {"message", "type", "code"} <= set(err)
            except Exception:
                self.bad_errors.append((kind, code, body[:200]))


async def client(http: httpx.AsyncClient, names: list[str], base: str, deadline: float,
                 tally: Tally, rng: random.Random, key: str) -> None:
    while time.monotonic() < deadline:
        roll = rng.random()
        if roll < 0.08:
            tally.faults["malformed"] += 1
            path = rng.choice(["/v1/completions", "/v1/chat/completions"])
            r = await http.post(path, content=rng.choice(MALFORMED),
                                headers={"content-type": "application/json"})
            tally.status("malformed", r.status_code, r.content)
            continue
        adapter = None if rng.random() < 0.1 else rng.choice(names)
        i, max_tokens = rng.randrange(len(PROMPTS)), rng.randint(4, 24)
        body = {"model": adapter or base, "prompt": PROMPTS[i], "max_tokens": max_tokens,
                "temperature": 0, "stream": rng.random() < 0.5}
        hang_up = rng.random() < 0.12
        if hang_up:
            tally.faults["disconnect"] += 1
        sent = time.monotonic()
        try:
            coro = _send(http, body, tally)
            text = await (asyncio.wait_for(coro, rng.uniform(0.05, 1.5)) if hang_up else coro)
        except TimeoutError:
            continue  # the client hung up mid-request: the server must clean up after it
        if text is not None:
            tally.records.append(Record(adapter, i, max_tokens, text, sent, time.monotonic()))


async def _send(http: httpx.AsyncClient, body: dict, tally: Tally) -> str | None:
    kind = "stream" if body["stream"] else "complete"
    if not body["stream"]:
        r = await http.post("/v1/completions", json=body)
        tally.status(kind, r.status_code, r.content)
        return r.json()["choices"][0]["text"] if r.status_code == 200 else None
    parts = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally.status(kind, r.status_code, await r.aread())
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:  # an error after the stream began
                    tally.status(kind, data["error"].get("status", 500), line[6:].encode())
                    return None
                parts.extend(c.get("text", "") for c in data.get("choices", []))
    tally.status(kind, 200)
    return "".join(parts)


async def churn(http: httpx.AsyncClient, paths: dict[str, list[str]], deadline: float,
                tally: Tally, rng: random.Random, admin: dict) -> None:
    """Every ~0.5-1.5 s: reload a name with new weights, reload it as it is, unload then
    load back later, or pin one; each change of weights is logged with its time."""
    names = sorted(paths)
    current = {n: paths[n][0] for n in names}
    for n in names:
        tally.versions[n] = [(0.0, current[n])]

    async def load(name: str, path: str, pinned: bool = False) -> int:
        r = await http.post("/v1/load_lora_adapter", headers=admin,
                            json={"lora_name": name, "lora_path": path, "pinned": pinned})
        tally.status("load", r.status_code, r.content)
        return r.status_code

    async def unload(name: str) -> int:
        tally.versions[name].append((time.monotonic(), None))  # from now on: maybe gone
        r = await http.post("/v1/unload_lora_adapter", headers=admin, json={"lora_name": name})
        tally.status("unload", r.status_code, r.content)
        return r.status_code

    pinned: list[str] = []
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        name, roll = rng.choice(names), rng.random()
        if roll < 0.1 and not pinned:
            tally.faults["pin"] += 1
            if await load(name, current[name], pinned=True) == 200:
                pinned.append(name)
            continue
        fresh = roll < 0.55  # new weights under the same name, else the same files again
        tally.faults["new_weights" if fresh else "reload_same"] += 1
        new = current[name]
        if fresh:
            new = paths[name][1] if current[name] == paths[name][0] else paths[name][0]
        await unload(name)
        if name in pinned:
            pinned.remove(name)
        if rng.random() < 0.3:
            await asyncio.sleep(rng.uniform(0.1, 1.0))  # requests meanwhile: a 404
        since = time.monotonic()  # requests may run on the new weights from here on
        if await load(name, new) == 200:
            current[name] = new
            tally.versions[name].append((since, new))
