"""The tenant pace, driven without a model: which decodes a step protects (row_share.py), the
bound on average with its debt (StepPace `average`), and the scheduler that puts them
together: a client within its share of seats decodes in every step, the decodes of a client
above its share and prefill share the paced budget, a newcomer is admitted even in a step
left to the protected decodes, and with one client nothing changes."""

from __future__ import annotations

import pytest
from test_fair_scheduling import creq, ids
from test_scheduler import make, run, step

from loraserve.config import EngineConfig
from loraserve.scheduler.row_share import split_rows
from loraserve.scheduler.step_pace import StepPace


def test_rows_of_clients_above_their_share_of_seats_are_paced():
    a = [creq(f"a{i}", 4, "a") for i in range(6)]
    b, c = creq("b", 4, "b"), creq("c", 4, "c")
    # 8 seats, 3 clients: a share of 8/3; "a" holds 6 of them
    protected, paced = split_rows([*a, b], [*a, b], [c], max_seats=8)
    assert protected == [b] and paced == a
    # alone, a client's every decode is protected, however many it has
    assert split_rows(a, a, [], max_seats=8) == (a, [])
    # within their share (4 seats each of 8), both are protected
    protected, paced = split_rows([*a[:4], b], [*a[:4], b], [], max_seats=8)
    assert protected == [*a[:4], b] and paced == []


def test_the_average_bound_holds_with_a_chunk_over_the_bound_at_its_floor():
    pace = StepPace(factor=2.0, max_tokens=512, min_chunk=16, average=True)
    pace.observe(3, 0, 0.010)  # the protected decodes alone: 10 ms
    times = []
    for _ in range(60):  # a chunk costs 60 ms even at the floor: 6x the reference
        p = pace.prefill_budget(3, True)
        seconds = 0.010 + (0.050 if p else 0.0)
        pace.observe(3, p, seconds)
        times.append(seconds)
    assert pace.budget == 16  # the floor: the long prompt still progresses ...
    assert sum(1 for t in times if t > 0.010) >= 10  # ... every few steps
    assert sum(times) / len(times) <= 2.0 * 0.010 * 1.05  # the average pace holds
    per_step = StepPace(factor=2.0, max_tokens=512, initial=16)  # without `average`
    per_step.observe(3, 0, 0.010)
    for _ in range(5):
        per_step.observe(3, 16, 0.060)
        assert per_step.prefill_budget(3) == 16  # no debt: the floor, every step


def test_a_client_within_its_share_decodes_every_step_the_others_share_the_budget():
    s = make(kv_tokens=8192, max_num_seqs=8)
    heavy = [creq(f"h{i}", 4, "h", max_tokens=40, origin=f"h{i}") for i in range(7)]
    for r in heavy:
        s.add(r)
    step(s)
    light = creq("light", 4, "l", max_tokens=30)
    s.add(light)
    step(s)  # "l" is below its share (4 of 8 seats): it takes a seat from "h"
    assert light in s.running
    s.tenant_pace.observe(1, 0, 0.010)
    s.tenant_pace.budget, s.tenant_pace.probe_every = 3, 10**6
    heavy_rows = []
    while not light.is_finished:
        batch = step(s)
        rows = [r.request_id for r, _ in batch.entries]
        assert "light" in rows  # protected: in every step
        assert batch.num_protected == 1 and batch.num_decodes == len(rows)
        heavy_rows.append(sum(1 for r in rows if r.startswith("h")))
    assert max(heavy_rows) == 3  # the paced budget, not every seat "h" holds
    run(s, limit=2000)
    assert all(r.num_output_tokens == 40 for r in heavy)  # rotated, none starved


def test_debt_steps_still_admit_a_newcomer_but_no_paced_work():
    s = make(kv_tokens=8192, max_num_seqs=8, max_num_batched_tokens=512)
    long = creq("long", 2000, "a", max_tokens=2)
    light = creq("light", 4, "b", max_tokens=50)
    s.add(light)
    s.add(long)
    step(s)
    assert light in s.running and long in s.running
    s.tenant_pace.observe(1, 0, 0.010)
    s.tenant_pace.debt = 1.0  # a chunk ran far over the bound: pay it back first
    newcomer = creq("new", 6, "c", max_tokens=3)
    s.add(newcomer)
    batch = step(s)
    assert [r.request_id for r in batch.admitted] == ["new"]
    assert all(r is not long for r, _ in batch.entries)  # its next chunk waits
    s.add(creq("new2", 6, "a", max_tokens=3))  # "a" has a request running: not a newcomer
    assert all(r.request_id != "new2" for r, _ in step(s).entries)


def test_each_newcomer_gets_its_own_first_chunk_in_a_debt_step():
    """Three short prompts arriving together in a debt step each start whole (a budget shared
    between them had cut the last one, which then waited for the debt like paced work); a
    prompt longer than one chunk finishes its rest in the next debt step; the long prompt
    waits throughout."""
    s = make(kv_tokens=8192, max_num_seqs=8, max_num_batched_tokens=512)
    long = creq("long", 2000, "a", max_tokens=2)
    s.add(creq("light", 4, "b", max_tokens=50))  # decoding: the debt is paid for it
    s.add(long)
    step(s)
    s.tenant_pace.observe(1, 0, 0.010)
    s.tenant_pace.debt = 1.0
    chunk = s.tenant_pace.min_chunk
    short = [creq(f"s{i}", 12, f"c{i}", max_tokens=3) for i in range(3)]
    longer = creq("longer", chunk + 5, "d", max_tokens=3)
    for r in [*short, longer]:
        s.add(r)
    batch = step(s)
    fed = {r.request_id: n for r, n in batch.entries}
    assert fed == {"light": 1, "s0": 12, "s1": 12, "s2": 12, "longer": chunk}
    assert all(r.num_output_tokens == 1 for r in short)  # whole prompts: a token each
    batch = step(s)  # still in debt: the rest of "longer", the short ones' decodes
    fed = {r.request_id: n for r, n in batch.entries}
    assert fed.get("longer") == 5 and "long" not in fed


def test_one_client_is_paced_as_before():
    s = make(kv_tokens=8192, max_num_seqs=8)
    reqs = [creq(f"r{i}", 4, "a", max_tokens=6, origin=f"o{i}") for i in range(8)]
    for r in reqs:
        s.add(r)
    step(s)
    s.tenant_pace.observe(1, 0, 0.010)
    s.tenant_pace.budget, s.tenant_pace.debt = 1, 1.0
    batch = step(s)
    assert len(batch.entries) == 8 and batch.num_protected == 8  # the tenant pace is idle
    off = make(kv_tokens=8192, max_num_seqs=8, tenant_pace_factor=0.0)
    assert off.tenant_pace is None
    with pytest.raises(ValueError, match="tenant_pace_factor"):
        EngineConfig(tenant_pace_factor=1.0)


def test_one_clients_decode_only_steps_seed_the_tenant_pace_reference():
    # the engine's start-up calibration runs as one client: its decode-only steps are the
    # reference steps between clients need, so those are not left decode-only to measure it
    s = make(kv_tokens=8192, max_num_seqs=8)
    for i in range(2):
        s.add(creq(f"a{i}", 4, "a", max_tokens=8))
    batch = step(s)  # the prompts: not a reference of either pace
    s.observe(batch, 0.050)
    assert s.tenant_pace.reference(2) is None and not s.last_shared
    batch = step(s)
    assert batch.num_tokens == batch.num_decodes == 2
    s.observe(batch, 0.010)
    assert s.tenant_pace.reference(2) == pytest.approx(0.010)
    assert s.pace.reference(2) == pytest.approx(0.010)
    s.add(creq("b", 4, "b", max_tokens=8))  # a second client: its prompt goes in at once
    batch = step(s)
    assert s.last_shared and "b" in ids(batch)
