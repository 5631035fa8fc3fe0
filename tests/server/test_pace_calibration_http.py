"""A server started with its defaults times its decode pace before it listens
(engine/pace_calibration.py), and serves as usual afterwards."""

from __future__ import annotations

from server_utils import ServerProcess


def test_a_default_server_calibrates_then_serves(tiny_model_dir, tmp_path):
    with ServerProcess(tiny_model_dir, log_dir=tmp_path, calibrate=True) as srv:
        model = srv.get("/v1/models").json()["data"][0]["id"]
        r = srv.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3],
                                              "max_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        state = srv.state()
        log = srv.log()
    assert "decode pace calibrated at batch sizes up to" in log
    # its own requests are gone: none running, none waiting
    assert state["running"] == 0 and state["waiting"] == 0
