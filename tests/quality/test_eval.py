"""The committed model makes the task real: full prefill answers everything, chunk reuse loses cross facts.

The engine test is the CI gate of issue #7: through ``Engine.prefill`` on the CPU, full >= 0.98 on
every type, ``tessera@0`` keeps direct/local >= 0.95 and drops cross <= 0.30, ``tessera@1`` answers
exactly as full does.
"""

from __future__ import annotations

import json

import pytest
import torch

from loadgen.quality.cli import COMMITTED_MODEL
from loadgen.quality.evaluate import Mode, evaluate_modes, parse_modes, select_questions
from loadgen.quality.model import load_hf
from loadgen.quality.reference import ReferenceEngine, reference_tally
from loadgen.quality.tasks import KINDS, heldout_prompts
from services.cli import main as tessera

PROMPTS = 300


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(seed=1, n=PROMPTS)


def test_mode_parsing():
    assert parse_modes("full, tessera@0.15,blend_copy@1") == [Mode("full", None), Mode("tessera", 0.15), Mode("blend_copy", 1.0)]
    assert str(Mode.parse("tessera@0")) == "tessera@0"
    for bad in ("nope", "tessera@x", "tessera@1.5", ""):
        with pytest.raises(ValueError):
            parse_modes(bad)


def test_select_questions_takes_kinds_in_turn(prompts):
    for p in prompts[:50]:
        picked = select_questions(p, 3)
        kinds_present = {f.kind for f in p.question_facts()}
        assert {f.kind for f in picked} == kinds_present or len({f.kind for f in picked}) == 3
        assert len(picked) == min(3, len(p.questions))
    assert len(select_questions(prompts[0], 8)) == len(prompts[0].questions)


@pytest.mark.slow
def test_committed_model_reference_accuracy(prompts):
    """Teacher-forced, all 8 questions: the engine-free measure that training logs."""
    model = load_hf(COMMITTED_MODEL)
    prompts = prompts[:150]
    full = reference_tally(model, prompts).accuracy()
    reuse = reference_tally(model, prompts, reuse=True).accuracy()
    assert min(full.values()) >= 0.98, full
    assert reuse["direct"] >= 0.95 and reuse["local"] >= 0.95, reuse
    assert reuse["cross"] <= 0.30, reuse


@pytest.mark.slow
def test_engine_modes_on_the_committed_model(prompts):
    from services.engine import Engine

    engine = Engine.load(COMMITTED_MODEL, device="cpu", dtype=torch.float32)
    full, reuse, recompute_all = evaluate_modes(
        engine, parse_modes("full,tessera@0,tessera@1.0"), prompts, questions=3, progress=False)
    assert all(n >= 200 for n in full.tally.asked), full.tally  # every kind asked a few hundred times
    f, r = full.tally.accuracy(), reuse.tally.accuracy()
    assert min(f.values()) >= 0.98, f
    assert r["direct"] >= 0.95 and r["local"] >= 0.95, r
    assert r["cross"] <= 0.30, r
    assert recompute_all.answers == full.answers
    assert recompute_all.tally == full.tally


@pytest.mark.slow
def test_engine_reuse_agrees_with_the_reference(prompts):
    """tessera@0 through the engine answers as the masked reference pass does, question by question."""
    from services.engine import Engine

    engine = Engine.load(COMMITTED_MODEL, device="cpu", dtype=torch.float32)
    reference = ReferenceEngine.load(str(COMMITTED_MODEL))
    few = prompts[:25]
    ours = evaluate_modes(engine, [Mode("tessera", 0.0), Mode("position_aware", 0.0)], few, questions=3, progress=False)
    ref = evaluate_modes(reference, [Mode("tessera", 0.0)], few, questions=3, progress=False)[0]
    assert ours[0].answers == ref.answers == ours[1].answers


def test_cli_json(capsys):
    rc = tessera(["quality", "eval", "--prompts", "4", "--questions", "3", "--modes", "full,tessera@0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["full", "tessera@0"]
    for acc in out.values():
        assert set(acc) == set(KINDS) and all(0.0 <= a <= 1.0 for a in acc.values())
    assert out["full"]["cross"] == 1.0


def test_cli_rejects_bad_input(capsys):
    assert tessera(["quality", "eval", "--modes", "tessera@2"]) == 2
    assert tessera(["quality", "eval", "--prompts", "0"]) == 2
    assert tessera(["quality", "eval", "--reference", "--modes", "tessera@0.15", "--prompts", "1"]) == 2
    assert "error" in capsys.readouterr().err
