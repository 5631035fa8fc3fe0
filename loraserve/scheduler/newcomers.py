"""Who may still start in a step the tenant pace leaves to the protected decodes.

Such a step (a reference step, or one paying back the pace's debt: step_pace.py) carries no
paced work, but a client that is new still gets its first chunk, so a short request never
waits for another client's long prompt to pay its debt. A client is new when it has nothing
running, or when its only running request is a prompt whose rest fits in one first chunk (it
was admitted with part of its prompt, the step's tokens shared with other newcomers); a
request of a client with more running, and every paced decode, waits for a paced step.

Each new client takes at most `chunk` tokens (min_chunk), one request per client, all within
the tokens left in the step: the step grows by a few short prompts at most. The long prompt
of a client that has only it running does not count as new until its last chunk."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from loraserve.request import Request, RequestStatus
from loraserve.scheduler.fair_share import client_key


class Newcomers:
    def __init__(self, running: Iterable[Request], chunk: int, step_tokens: int):
        self.seats = Counter(client_key(r) for r in running)
        self.per_client = chunk
        self.left = step_tokens  # tokens the step may still take
        self.served: set[str | None] = set()  # new clients that took their chunk this step

    def may_take(self, req: Request, paced_decode: bool) -> bool:
        client = client_key(req)
        if paced_decode or client in self.served:
            return False
        if req.status is RequestStatus.RUNNING:  # only its own prompt, nearly done
            rest = req.num_tokens - req.num_computed_tokens
            return self.seats[client] == 1 and rest <= self.per_client
        return self.seats[client] == 0

    def chunk(self) -> int:
        """Tokens the next new client may take."""
        return min(self.per_client, self.left)

    def took(self, req: Request, n: int) -> None:
        self.served.add(client_key(req))
        self.left -= n
