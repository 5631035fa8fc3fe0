"""Fairness between clients by tokens served: the Virtual Token Counter (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

Every client has a counter of the service it received: each prefill token computed for it adds
1, each decode token `decode_weight`, both times (1 + context_cost x the token's position),
since a token attends to every position before it: a chunk deep in a long prompt costs the
engine several times a short prompt's token, and is charged so. Whenever the scheduler has
prefill work to hand out (a new request to admit, or the next chunk of a long prompt), the
client with the lowest counter goes first; a client that arrives (has no live request) has its
counter lifted to the lowest counter among the active clients, so idling earns no credit to
flood with later, and a newcomer is never behind the ones already served. A client with many
sequences thus gets its share of the prefill budget and of the seats, not the machine.

Within one client, the request served least goes first (fewest tokens computed, then the
earliest): a short request is not held behind its own client's long prompt. When every seat
is taken, a client below an equal share of them takes one from the most served client above
its share (`seat_victim`).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Iterator

from loraserve.request import Request


def client_key(req: Request) -> str | None:
    """Who fairness is between: the client (API key tenant or address); requests that name
    none (the offline API, tests) are told apart by their client request."""
    return req.client_id if req.client_id is not None else req.origin


class VirtualTokenCounter:
    def __init__(self, decode_weight: float = 2.0, context_cost: float = 0.0):
        self.decode_weight = decode_weight
        self.context_cost = context_cost  # ModelConfig.attention_cost_per_position
        self.counters: dict[str | None, float] = {}
        self.live: Counter[str | None] = Counter()  # live requests per client

    def counter(self, client: str | None) -> float:
        return self.counters.get(client, 0.0)

    def arrive(self, req: Request) -> None:
        """A request was queued."""
        client = client_key(req)
        if self.live[client] == 0:
            active = [self.counter(c) for c, n in self.live.items() if n > 0]
            if active:
                self.counters[client] = max(self.counter(client), min(active))
            self.live[client] += 1
            self._forget_idle()
        else:
            self.live[client] += 1

    def leave(self, req: Request) -> None:
        """A request ended."""
        client = client_key(req)
        self.live[client] -= 1
        if self.live[client] <= 0:
            del self.live[client]
            if not self.live:  # nobody is waiting for anyone: the past is settled
                self.counters.clear()

    def charge(self, req: Request, prefill_tokens: int = 0, decode_tokens: int = 0,
               ahead: int = 0) -> None:
        """Service given to `req`'s client this step: tokens from its next position on, past
        the `ahead` this step has already charged (a run's later decodes: decode_runs.py)."""
        client = client_key(req)
        start = req.num_computed_tokens + ahead
        cost = (self._tokens(prefill_tokens, start)
                + self.decode_weight * self._tokens(decode_tokens, start + prefill_tokens))
        self.counters[client] = self.counter(client) + cost

    def _tokens(self, n: int, start: int) -> float:
        """n tokens at positions start.. : each 1 plus what its context costs."""
        return n * (1.0 + self.context_cost * (start + (n - 1) / 2)) if n else 0.0

    def _forget_idle(self) -> None:
        # An idle client whose counter is at most the lowest active one would be lifted to
        # that on return anyway: its counter carries nothing, drop it (bounded memory).
        active = [self.counter(c) for c, n in self.live.items() if n > 0]
        if not active:
            return
        low = min(active)
        for c in [c for c, v in self.counters.items() if c not in self.live and v <= low]:
            del self.counters[c]

    def seat_victim(self, req: Request, running: list[Request], waiting: Iterable[Request],
                    max_seats: int) -> Request | None:
        """Every seat is taken and `req`'s client holds less than an equal share of them
        (max_seats / clients with requests running or waiting): the seat it should get, the
        last admitted request of the most served client above its share, if that client was
        served at least as much (a newcomer is lifted to the least served, so to equal).
        Without this, a client that filled the seats while the others were idle would keep
        them for as long as its sequences decode. A pure query."""
        seats = Counter(client_key(r) for r in running)
        share = max_seats / len(set(seats) | {client_key(r) for r in waiting})
        mine = client_key(req)
        if seats[mine] + 1 > share:
            return None
        over = [c for c, n in seats.items() if n > share and self.counter(c) >= self.counter(mine)]
        if not over:
            return None
        most = max(over, key=self.counter)
        return next(r for r in reversed(running) if client_key(r) == most)

    def order(self, candidates: Iterable[Request]) -> Iterator[Request]:
        """The candidates, lowest-counter client first, re-ranked after each one is taken
        (the caller's charges for it count before the next is picked)."""
        queues: dict[str | None, list[tuple[int, int, Request]]] = defaultdict(list)
        for i, req in enumerate(candidates):
            queues[client_key(req)].append((req.num_computed_tokens, i, req))
        per_client = {c: deque(r for *_, r in sorted(q, key=lambda e: e[:2]))
                      for c, q in queues.items()}
        heap = [(self.counter(c), n, c) for n, c in enumerate(per_client)]
        heapq.heapify(heap)
        while heap:
            _, n, c = heapq.heappop(heap)
            queue = per_client[c]
            yield queue.popleft()
            if queue:
                heapq.heappush(heap, (self.counter(c), n, c))
