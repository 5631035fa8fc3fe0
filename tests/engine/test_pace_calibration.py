"""The decode pace's references are measured at startup for every batch size class, so a fresh
engine's first burst is judged by a decode-only step of the batch it will make, and nothing
of the calibration stays behind (engine/pace_calibration.py)."""

from __future__ import annotations

from loraserve.config import EngineConfig
from loraserve.engine.engine import LLMEngine
from loraserve.engine.pace_calibration import batch_sizes
from loraserve.types import SamplingParams


def _engine(model_dir, **knobs) -> LLMEngine:
    knobs.setdefault("max_num_seqs", 32)
    return LLMEngine(model_dir, EngineConfig(device="cpu", **knobs))


def test_batch_sizes_cover_every_size_class_up_to_the_largest_batch():
    assert batch_sizes(128, 10**6) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert batch_sizes(48, 10**6) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes(128, 5) == [1, 2, 4, 5]  # what the KV cache holds
    assert batch_sizes(1, 10**6) == [1]


def test_a_fresh_engine_has_a_reference_for_every_size_class(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    pace = eng.scheduler.pace
    assert sorted(pace.decode_s) == [1, 2, 3, 4, 5, 6]  # 1, 2-3, ..., 32-63
    assert all(t > 0 for t in pace.decode_s.values())
    # the first step of a burst of 32 (one decode running, 31 waiting) is judged by a
    # decode-only step of 32, not by the lone decode's
    assert pace.judged_by(1, rows=32) == pace.decode_s[6]
    assert pace.prefill_budget(1, rows=32) > 0


def test_the_calibration_leaves_nothing_behind(tiny_model_dir):
    eng = _engine(tiny_model_dir)
    assert not eng.has_work and not eng.requests
    assert eng.kv.pool.num_used == 0 and eng.kv.pool.num_cached == 0
    assert eng.num_steps == 0
    assert eng.base_prefix.prefix_queries == 0


def test_answers_do_not_depend_on_the_calibration(tiny_model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [1] * 20, [int(i) for i in range(40, 3, -1)]]

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"q{i}")
        out = {}
        while eng.has_work:
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
        return out

    assert run(_engine(tiny_model_dir)) == run(_engine(tiny_model_dir, pace_calibration=False))


def test_a_small_kv_cache_limits_the_sizes(tiny_model_dir):
    eng = _engine(tiny_model_dir, kv_cache_tokens=4 * 16, block_size=16)
    assert sorted(eng.scheduler.pace.decode_s) == [1, 2, 3]  # batches of 1, 2 and 4


def test_without_a_decode_pace_nothing_is_calibrated(tiny_model_dir):
    assert _engine(tiny_model_dir, decode_pace_factor=0).scheduler.pace.decode_s == {}
    assert _engine(tiny_model_dir, pace_calibration=False).scheduler.pace.decode_s == {}
