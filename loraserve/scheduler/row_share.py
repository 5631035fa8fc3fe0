"""Which running decodes a step protects when several clients share the engine.

A client that holds at most its share of the seats (max_num_seqs / the clients with requests
running or waiting) has every decode in every step: those rows are protected, and a step of
only them is the reference the tenant pace (step_pace.py, `average`) bounds the others by.
The decodes of a client above its share are paced work, like prefill: they take the step's
budget in fair order (fair_share.py), the least served client first. So one client's many
sequences (a fan-out, a thousand open streams) lengthen the steps of the clients within
their share by at most the pace factor, on average, and whatever the bound leaves still goes
to them: nothing is capped while nobody else needs the time.

With one client, or fair scheduling off, every decode is protected (the decode pace alone).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from loraserve.request import Request
from loraserve.scheduler.fair_share import client_key


def split_rows(decodes: list[Request], running: Iterable[Request], waiting: Iterable[Request],
               max_seats: int) -> tuple[list[Request], list[Request]]:
    """(protected, paced) decodes, each in the order given: the decodes of clients holding
    more than max_seats / clients of the running seats are paced, the rest protected."""
    seats = Counter(client_key(r) for r in running)
    clients = set(seats) | {client_key(r) for r in waiting}
    if len(clients) <= 1:
        return decodes, []
    share = max_seats / len(clients)
    over = {c for c, n in seats.items() if n > share}
    protected = [r for r in decodes if client_key(r) not in over]
    return protected, [r for r in decodes if client_key(r) in over]
