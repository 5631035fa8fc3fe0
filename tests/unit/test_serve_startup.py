"""`loraserve serve` start-up without a model: what it says when Ray is not installed."""

from __future__ import annotations

import sys

import pytest

from loraserve.cli import main


def test_replicas_without_ray_say_in_one_line_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # importlib finds no ray
    for flags in (["--replicas", "2"], ["--ray-address", "auto"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", *flags, "--port", "0"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err, err
        assert "pip install 'loraserve[cluster]'" in err and "Traceback" not in err, err
