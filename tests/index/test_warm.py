"""services/index/warm.py: every compiled path of the index set run once per storage dtype (what ``make test`` runs
before the tests, to fill numba's cache); a dtype it does not know is refused before anything runs."""

from __future__ import annotations

import pytest

from services.index import _layer, warm


def test_warm_readies_the_layer_call_for_each_dtype_it_is_given(capsys):
    seconds = warm.warm(["float32", "bfloat16"], say=print)
    assert sorted(seconds) == ["bfloat16", "float32"] and all(s > 0 for s in seconds.values())
    assert _layer.ready("float32") and _layer.ready("bfloat16")
    assert capsys.readouterr().out.count("index loops for") == 2


def test_the_command_refuses_an_unknown_dtype(capsys):
    with pytest.raises(ValueError, match="--dtypes must be one of"):
        warm.main(["--dtypes", "float32,float16"])
    assert "ready" not in capsys.readouterr().out
