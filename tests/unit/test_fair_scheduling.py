"""Scheduling that bounds the harm one request can do, driven without a model: the prefill
budget fitted to step costs (scheduler/step_pace.py), fairness between clients by tokens
served (scheduler/fair_share.py), the fair share of seats per client, and pausing requests
whose client does not read (Scheduler.pause / resume / stalled)."""

from __future__ import annotations

from test_scheduler import fake_model, make, run, step

from loraserve.request import Request, RequestStatus
from loraserve.scheduler.fair_share import VirtualTokenCounter
from loraserve.scheduler.step_pace import StepPace
from loraserve.types import FinishReason, SamplingParams


def creq(rid: str, n: int, client: str | None, max_tokens: int = 4, origin=None) -> Request:
    return Request(rid, list(range(4, 4 + n)), SamplingParams(max_tokens=max_tokens),
                   client_id=client, origin=origin)


def ids(batch) -> list[str]:
    return [r.request_id for r, _ in batch.entries]


# ---- the prefill budget -----------------------------------------------------------------------


def test_step_pace_probes_the_decodes_then_steers_the_budget_to_the_factor():
    pace = StepPace(factor=3.0, max_tokens=2048, min_chunk=16, initial=256, probe_every=8)
    assert pace.prefill_budget(4) == 2048  # nothing measured yet: no cap
    pace.observe(0, 300, 0.5)  # a prefill-only step: no reference to judge it by
    assert pace.prefill_budget(0, True) == 256  # nobody decodes: the last budget holds
    assert pace.prefill_budget(4) == 0  # no reference at 4 decodes: measure them alone, once
    pace.observe(4, 0, 0.020)  # 20 ms a decode-only step
    assert pace.prefill_budget(4) == 256  # no long prompt: decode-only steps come by themselves

    def step_time(prefill):  # 20 ms + 1 ms a prefill token: the factor is met at 40 tokens
        return 0.020 + 0.001 * prefill

    for _ in range(7):
        p = pace.prefill_budget(4, True)
        assert p > 0
        pace.observe(4, p, step_time(p))
    for _ in range(40):
        p = pace.prefill_budget(4, True)
        pace.observe(4, p, step_time(p)) if p else pace.observe(4, 0, step_time(0))
    assert 25 <= pace.budget <= 60  # about (3 - 1) x 20 ms / 1 ms = 40
    probes = 0
    for _ in range(32):  # a decode-only step now and then keeps the reference fresh
        p = pace.prefill_budget(4, True)
        probes += p == 0
        pace.observe(4, p, step_time(p))
    assert 3 <= probes <= 4


def test_step_pace_keeps_a_reference_per_batch_size_and_bounds_idle_steps():
    pace = StepPace(factor=3.0, max_tokens=2048, initial=256)
    pace.observe(1, 0, 0.004)  # one decode alone: 4 ms
    assert pace.prefill_budget(1) == 256
    # 32 decodes: a step of one decode's reference would misjudge them, so they are measured
    assert pace.prefill_budget(32) == 0
    pace.observe(32, 0, 0.030)
    assert pace.reference(32) == 0.030 and pace.reference(40) == 0.030
    assert pace.reference(1) == 0.004 and pace.reference(3) is None
    pace.observe(32, 256, 0.060)  # 2x its own reference (15x one decode's): it grows
    assert pace.prefill_budget(32) > 256
    # two decodes of a burst whose thirty others wait: held to the pace of the 32 they will
    # make (30 ms), not to their own (4 ms), so the prompts behind them are not starved
    pace.observe(2, 0, 0.004)
    assert pace.judged_by(2, 32) == 0.030 and pace.judged_by(2, 0) == 0.004
    assert pace.judged_by(2, 12) == 0.004  # 8-15 unmeasured: the nearest size below
    before = pace.prefill_budget(2, rows=32)
    pace.observe(2, before, 0.060)  # 15x their own pace, 2x the batch's: it grows
    assert pace.prefill_budget(2, rows=32) > before
    # with nobody decoding the step stays bounded: a new request must not wait behind a long one
    assert pace.prefill_budget(0, True) == int(pace.budget) < 2048


def test_step_pace_grows_a_small_budget_for_a_burst_with_nobody_decoding():
    # a budget left small by the end of the burst before; 32 prompts arrive at once and
    # prefill with no decodes: judged by the step of the 32 they will make, it opens up to
    # the factor, and a step over the factor with nobody decoding does not shrink it
    pace = StepPace(factor=3.0, max_tokens=2048, initial=40)
    pace.observe(32, 0, 0.040)  # 32 decodes: 40 ms

    def step_time(prefill):  # 1 ms a prompt token
        return 0.001 * prefill

    for _ in range(30):
        p = pace.prefill_budget(0, True, rows=32)
        pace.observe(0, p, step_time(p))
    assert 90 <= pace.budget <= 130  # about 3 x 40 ms / 1 ms
    before = pace.budget
    pace.observe(0, int(before), 10.0)  # a slow step, nobody decoding: no evidence to shrink
    assert pace.budget == before
    # a lone prompt on an idle engine is judged by one decode's step: over it, no change
    alone = StepPace(factor=3.0, max_tokens=2048, initial=256)
    alone.observe(1, 0, 0.010)
    alone.prefill_budget(0, True, rows=1)
    alone.observe(0, 256, 0.256)
    assert alone.budget == 256
    # several clients (rows 0): nothing to judge by, the budget holds
    shared = StepPace(factor=3.0, max_tokens=2048, initial=40)
    shared.observe(32, 0, 0.040)
    shared.prefill_budget(0, True, rows=0)
    shared.observe(0, 40, 0.040)
    assert shared.budget == 40


def test_step_pace_ignores_steps_the_budget_did_not_bind_and_can_be_off():
    pace = StepPace(factor=3.0, max_tokens=512, initial=256)
    pace.observe(2, 0, 0.010)
    pace.observe(2, 10, 0.012)  # a short prompt, far under budget and under the factor
    assert pace.budget == 256
    pace.observe(2, 10, 0.200)  # far over the factor, whatever bound it: shrink
    assert pace.budget == 128
    for _ in range(20):
        pace.observe(2, 500, 60.0)
    assert pace.budget == 16  # never below the floor: long prompts progress
    off = StepPace(factor=0.0, max_tokens=512)
    off.observe(1, 100, 5.0)
    assert off.prefill_budget(1) == 512


def test_step_pace_follows_a_slower_host_without_opening_the_budget():
    # every step 20x slower (other processes on the host): the budget never opens; once the
    # reference has followed (both ways), it is where it was
    pace = StepPace(factor=3.0, max_tokens=2048, initial=40)
    pace.observe(4, 0, 0.020)
    for slow in (1.0, 20.0, 1.0):
        for _ in range(120):
            p = pace.prefill_budget(4, True)
            pace.observe(4, p, slow * (0.020 + 0.001 * p))
            assert p <= 60 or slow == 1.0
        assert 25 <= pace.budget <= 60


def test_long_prompt_is_chunked_to_the_pace_while_others_decode():
    s = make(kv_tokens=4096, max_num_batched_tokens=2048)
    s.pace.observe(1, 0, 0.010)
    s.pace.budget, s.pace.probe_every = 21, 10**6  # no decode-only probes in this test
    short = creq("short", 6, "b", max_tokens=8)
    s.add(short)
    step(s)
    long = creq("long", 1500, "a", max_tokens=2)
    s.add(long)
    sizes = []
    while not short.is_finished:
        batch = step(s)
        sizes.append(dict((r.request_id, n) for r, n in batch.entries).get("long", 0))
        assert batch.num_tokens <= 1 + 21  # one decode + the paced prefill
    assert sizes and max(sizes) == 21
    run(s)
    assert long.is_finished and long.num_output_tokens == 2


# ---- fairness between clients -----------------------------------------------------------------


def test_new_short_request_goes_before_the_next_chunk_of_a_long_prompt():
    s = make(kv_tokens=4096, max_num_batched_tokens=64)
    long = creq("long", 1000, "a")
    s.add(long)
    assert ids(step(s)) == ["long"]
    for i in range(3):  # same client, and another client: both go first
        s.add(creq(f"mine{i}", 5, "a"))
        s.add(creq(f"other{i}", 5, "b"))
        batch = step(s)
        assert ids(batch)[-1] == "long" and {f"mine{i}", f"other{i}"} <= set(ids(batch))
    run(s)
    assert long.num_output_tokens == 4


def test_fan_out_client_gets_its_share_of_admissions_not_the_machine():
    # client "a" sends 40 requests, each its own client request; "b" and "c" one each, later
    s = make(kv_tokens=8192, max_num_seqs=8, max_num_batched_tokens=4096)
    for i in range(40):
        s.add(creq(f"a{i}", 8, "a", max_tokens=20, origin=f"a-req{i}"))
    first = step(s)
    assert len(first.entries) == 8  # alone, "a" may use every seat
    s.add(creq("b0", 8, "b", max_tokens=3, origin="b-req"))
    s.add(creq("c0", 8, "c", max_tokens=3, origin="c-req"))
    admitted_at = {}
    for k in range(40):
        batch = step(s)
        for r in batch.admitted:
            admitted_at.setdefault(r.request_id, k)
        if "b0" in admitted_at and "c0" in admitted_at:
            break
    # b and c come in at the first free seats, ahead of a's 32 waiting requests
    assert max(admitted_at["b0"], admitted_at["c0"]) <= 20
    a_before = [r for r, k in admitted_at.items() if r.startswith("a") and
                k < max(admitted_at["b0"], admitted_at["c0"])]
    assert not a_before
    run(s, limit=1000)


def test_the_fair_share_of_seats_is_per_client_across_its_requests():
    # 8 seats, share 0.5: while "b" waits, "a" holds at most 4 seats however many client
    # requests it splits its sequences into; with fair scheduling off, per client request.
    s = make(kv_tokens=8192, max_num_seqs=8)
    for i in range(10):
        s.add(creq(f"a{i}", 3, "a", origin=f"a-req{i}"))
    for i in range(6):
        s.add(creq(f"b{i}", 3, "b", origin=f"b-req{i}"))
    clients = [r.client_id for r, _ in s.schedule().entries]
    assert clients.count("a") == 4 and clients.count("b") == 4
    off = make(kv_tokens=8192, max_num_seqs=8, fair_scheduling=False)
    for i in range(10):
        off.add(creq(f"a{i}", 3, "a", origin=f"a-req{i}"))
    for i in range(6):
        off.add(creq(f"b{i}", 3, "b", origin=f"b-req{i}"))
    clients = [r.client_id for r, _ in off.schedule().entries]
    assert clients.count("a") > 4  # each of a's requests is under its own share


def test_virtual_token_counter_lifts_newcomers_and_forgets_idle_clients():
    vtc = VirtualTokenCounter(decode_weight=2.0)
    a1, a2, b1, c1 = (creq("a1", 4, "a"), creq("a2", 4, "a"), creq("b1", 4, "b"),
                      creq("c1", 4, "c"))
    vtc.arrive(a1)
    vtc.charge(a1, prefill_tokens=100, decode_tokens=10)
    assert vtc.counter("a") == 120
    vtc.arrive(b1)  # lifted to the least served active client
    assert vtc.counter("b") == 120
    vtc.charge(b1, prefill_tokens=10)
    vtc.leave(a1)
    vtc.arrive(a2)  # back after idling: lifted to b's 130, no credit for the pause
    assert vtc.counter("a") == 130
    vtc.leave(a2)
    vtc.arrive(c1)  # a is idle and below the active minimum: forgotten
    assert "a" not in vtc.counters and vtc.counter("c") == 130
    vtc.charge(b1, decode_tokens=1)
    order = [r.request_id for r in vtc.order([creq("y", 4, "b"), creq("x", 4, "c")])]
    assert order == ["x", "y"]  # c was served less than b
    vtc.leave(b1)
    vtc.leave(c1)
    assert not vtc.counters and not vtc.live  # nobody active: nothing kept


def test_order_reranks_after_each_charge():
    vtc = VirtualTokenCounter()
    reqs = [creq(f"a{i}", 4, "a") for i in range(3)] + [creq(f"b{i}", 4, "b") for i in range(3)]
    for r in reqs:
        vtc.arrive(r)
    taken = []
    for r in vtc.order(reqs):
        taken.append(r.request_id)
        vtc.charge(r, prefill_tokens=4)
    assert taken == ["a0", "b0", "a1", "b1", "a2", "b2"]


# ---- pausing a request whose client does not read ---------------------------------------------


def test_paused_request_gives_back_its_seat_and_kv_and_resumes_to_the_end():
    s = make(kv_tokens=256, max_num_seqs=1)
    slow, other = creq("slow", 10, "a", max_tokens=6), creq("other", 5, "b", max_tokens=3)
    s.add(slow)
    s.add(other)
    step(s)
    step(s)
    assert slow.status is RequestStatus.RUNNING and other in s.waiting
    assert s.pause(slow) and not s.pause(slow)
    assert slow.block_table == [] and slow.status is RequestStatus.PAUSED and not s.check()
    while not other.is_finished:  # the seat went to the other client
        step(s)
    assert not s.has_work and s.kv.pool.num_free == s.kv.pool.num_blocks
    assert s.resume(slow) and not s.resume(slow)
    run(s)
    assert slow.num_output_tokens == 6 and slow.finish_reason is FinishReason.LENGTH


def test_stalled_and_finished_paused_requests():
    s = make()
    a, b = creq("a", 5, "x"), creq("b", 5, "y")
    s.add(a)
    s.add(b)
    s.update_from_output(batch := s.schedule(), fake_model(batch))
    s.pause(a)
    s.pause(b)  # a waiting request can be paused too
    assert s.stalled(3600.0) == [] and set(s.stalled(0.0)) == {a, b}
    s.finish(a, FinishReason.ABORT)
    assert "a" not in s.paused and not s.check()
    s.finish(b, FinishReason.ERROR, "stalled", 408)
    assert not s.paused and not s.vtc.live and s.kv.pool.num_free == s.kv.pool.num_blocks


def test_a_client_below_its_share_takes_a_seat_from_the_most_served():
    # "a" took all 4 seats while alone, with long decodes ahead; "b" arrives: it gets a seat
    # at the next step (a's last admitted is recomputed later), not when a's sequences end.
    s = make(kv_tokens=4096, max_num_seqs=4)
    a = [creq(f"a{i}", 6, "a", max_tokens=50, origin=f"a{i}") for i in range(4)]
    for r in a:
        s.add(r)
    step(s)
    step(s)
    b = creq("b", 6, "b", max_tokens=3)
    s.add(b)
    batch = step(s)
    assert b in batch.admitted and a[3].status is RequestStatus.WAITING
    assert batch.num_decodes == 3 and not batch.preempted and not s.check()
    # b's share is 2 of 4 seats: b2 takes a third seat from a, b3 waits for a free one
    b2, b3 = creq("b2", 6, "b", max_tokens=3), creq("b3", 6, "b", max_tokens=3)
    s.add(b2)
    s.add(b3)
    batch = step(s)
    assert b2 in batch.admitted and b3 not in batch.admitted
    assert sum(r.client_id == "b" for r in s.running) == 2
    run(s, limit=1000)
    assert all(r.num_output_tokens == 50 for r in a)
    off = make(kv_tokens=4096, max_num_seqs=4, fair_scheduling=False)
    for r in [creq(f"a{i}", 6, "a", max_tokens=50, origin=f"a{i}") for i in range(4)]:
        off.add(r)
    step(off)
    off.add(b := creq("b", 6, "b", max_tokens=3))
    assert b not in step(off).admitted  # first come, first served: b waits for a's end
