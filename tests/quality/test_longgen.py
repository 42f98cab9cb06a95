"""The longgen task says what it promises (every asked fact once, right targets, bounded lengths), its eval
parses modes strictly and scores by slot, and the committed model answers through the engine: dense nearly
always right, quest with a budget covering every page the very same tokens."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from loadgen.quality.cli import COMMITTED_LONGGEN_MODEL, COMMITTED_RELAY_MODEL
from loadgen.quality.longgen_eval import DecodeMode, evaluate_decode_modes, parse_decode_modes
from loadgen.quality.tasks import (FORMS, IGNORE, MAX_POSITIONS, LongGenConfig, bar_mask, longgen_batch,
                                   longgen_heldout, make_longgen_prompt, sample_longgen_batch)
from loadgen.quality.vocab import vocab
from services.cli import main as tessera

V = vocab()


def solve(tokens: list[int]) -> dict[int, int]:
    """An independent reader of a context: NAME -> OBJ wherever a name is followed by an object."""
    names, objects = set(V.names), set(V.objects)
    return {a: b for a, b in zip(tokens, tokens[1:]) if a in names and b in objects}


@pytest.mark.parametrize("seed", range(3))
def test_prompt_holds_every_asked_fact_once_and_the_target_answers_it(seed):
    cfg = LongGenConfig()
    rng = random.Random(seed)
    for n_chunks in (1, 5, cfg.max_chunks):
        n_facts = n_chunks * cfg.facts_per_chunk
        for k in {1, min(cfg.questions, n_facts)}:
            p = make_longgen_prompt(rng, cfg, n_chunks, k, V)
            assert len(p.chunks) == n_chunks and all(len(c) == cfg.chunk_len for c in p.chunks)
            flat = [t for c in p.chunks for t in c]
            pairs = list(zip(flat, flat[1:], flat[2:]))
            assert len({f.name for f in p.facts}) == len({f.obj for f in p.facts}) == len(p.facts) == n_facts
            for f in p.facts:
                assert pairs.count((f.name, f.obj, V.stop)) == 1, "every fact is stated exactly once"
                assert (f.name, f.obj, V.stop) in set(zip(p.chunks[f.chunk], p.chunks[f.chunk][1:], p.chunks[f.chunk][2:]))
                others = [b for a, b in zip(flat, flat[1:]) if a == f.name and b != f.obj]
                assert set(others) <= {V.verb}, "a name's other mentions are distractors `NAME arrives .`"
            assert solve(flat) == {f.name: f.obj for f in p.facts}
            assert len(set(p.questions)) == len(p.questions) == k
            target, suffix = p.target(V), p.suffix(V)
            assert suffix == [V.question, *(p.facts[i].name for i in p.questions), V.stop]
            assert target[-1] == V.eos and len(target) == 2 * k + 1
            assert [solve(flat)[n] for n in target[0:-1:2]] == target[1:-1:2]
            assert p.answers_right(target) == [True] * k and p.names_right(target) == [True] * k


@pytest.mark.parametrize("seed", range(2))
def test_relay_prompts_state_each_fact_as_adj_name_object_and_answer_it_in_four_slots(seed):
    cfg = LongGenConfig(form="relay")
    rng = random.Random(seed)
    for n_chunks in (1, cfg.max_chunks):
        k = min(cfg.questions, n_chunks * cfg.facts_per_chunk)
        p = make_longgen_prompt(rng, cfg, n_chunks, k, V)
        flat = [t for c in p.chunks for t in c]
        quads = list(zip(flat, flat[1:], flat[2:], flat[3:]))
        words = [f.adj for f in p.facts] + [f.obj for f in p.facts]
        assert len(set(words)) == len(words) and set(words) <= set(V.objects), "two fresh objects a fact"
        for f in p.facts:
            assert quads.count((f.adj, f.name, f.obj, V.stop)) == 1
        assert solve(flat) == {f.name: f.obj for f in p.facts}
        target = p.target(V)
        asked = p.question_facts()
        assert target == [t for f in asked for t in (f.name, V.pronoun, f.adj, f.obj)] + [V.eos]
        for role in FORMS["relay"]:
            assert p.slots_right(role, target) == [True] * k
        wrong = list(target)
        wrong[2] = V.objects[0] if wrong[2] != V.objects[0] else V.objects[1]     # the first question's A
        assert p.slots_right("adj", wrong) == [False] + [True] * (k - 1) and p.answers_right(wrong) == [True] * k
    with pytest.raises(ValueError, match="no 'adj' slot"):
        longgen_heldout(0, 1)[0].slots_right("adj", [])


def test_the_forms_leave_the_pair_prompts_as_they_were():
    """The pair form's held-out prompts, drawn before the forms existed (the results measured on them stand)."""
    import hashlib

    h = hashlib.sha256()
    for p in longgen_heldout(1, 5):
        h.update(bytes(str([list(c) for c in p.chunks] + [p.suffix(V), p.target(V)]), "ascii"))
    assert h.hexdigest() == "2ef29777e531db81d360d0e85c4065d10ab8359e1dbd3f8398a136d66c7afe4b"


def test_relay_training_bars_object_steps_from_the_chunks_and_the_step_before():
    prompts = longgen_heldout(4, 3, LongGenConfig(questions=5, form="relay"))
    b = longgen_batch(prompts, V, bar_object=1.0, rng=random.Random(0))
    mask = bar_mask(torch.from_numpy(b.barred), b.tokens.shape[1])[:, 0]
    causal = torch.ones_like(mask[0]).tril()
    for row, p in enumerate(prompts):
        chunks_end = 1 + sum(map(len, p.chunks))
        objects = [t for t in np.flatnonzero(b.targets[row] != IGNORE) if b.kinds[row, t] % 4 == 3]
        assert len(objects) == 5 and [b.targets[row, t] for t in objects] == [f.obj for f in p.question_facts()]
        for t in range(b.tokens.shape[1]):
            want = causal[t].clone()
            if t in objects:
                want[1:chunks_end] = False
                want[t - 1] = False        # the IT step; the name step (t - 2), <bos> and the suffix stay
            assert torch.equal(mask[row, t], want), t
    assert longgen_batch(prompts, V).barred is None
    half = longgen_batch(prompts, V, bar_object=0.5, rng=random.Random(1)).barred
    assert 0 < (half[..., 2] > 0).sum() < 15, "each object step barred by its own draw"
    with pytest.raises(ValueError, match="relay prompts"):
        longgen_batch(longgen_heldout(4, 1), V, bar_object=1.0, rng=random.Random(0))
    assert sample_longgen_batch(random.Random(0), LongGenConfig(form="relay"), 4, V).barred is not None
    assert sample_longgen_batch(random.Random(0), LongGenConfig(), 4, V).barred is None


def test_eval_shape_fits_the_model_with_its_generation():
    cfg = LongGenConfig()
    p = longgen_heldout(0, 1)[0]
    length = 1 + sum(map(len, p.chunks)) + len(p.suffix(V)) + len(p.target(V))
    assert length == cfg.seq_len <= MAX_POSITIONS
    assert 600 <= 1 + sum(map(len, p.chunks)) <= 900 and 8 <= len(p.questions) <= 16
    distractors = sum(c.count(V.verb) for c in p.chunks)
    assert 0 < distractors <= cfg.max_chunks * cfg.facts_per_chunk


def test_heldout_is_fixed_by_seed_and_fresh_per_prompt():
    a, b, c = longgen_heldout(1, 20), longgen_heldout(1, 20), longgen_heldout(2, 20)
    assert a == b and a != c
    assert len({p.question_facts()[0].name for p in a}) > 8


def test_slots_score_a_derailed_generation():
    p = longgen_heldout(3, 1, LongGenConfig(questions=4))[0]
    t = p.target(V)
    skipped = t[:2] + t[4:]                 # answer 2 skipped: every later slot is off by one
    assert p.answers_right(skipped) == [True, False, False, False]
    assert p.answers_right(t[:4]) == [True, True, False, False], "a generation that stopped early has no answer"
    wrong_obj = t[:3] + [V.objects[0] if t[3] != V.objects[0] else V.objects[1]] + t[4:]
    assert p.answers_right(wrong_obj) == [True, False, True, True] and p.names_right(wrong_obj) == [True] * 4


def test_batches_put_loss_on_the_target_only():
    prompts = longgen_heldout(4, 3, LongGenConfig(questions=5))
    b = longgen_batch(prompts, V)
    for row, p in enumerate(prompts):
        pos = np.flatnonzero(b.targets[row] != IGNORE)
        target = p.target(V)
        assert len(pos) == len(target) and b.tokens[row, pos[0]] == V.stop
        assert b.targets[row, pos].tolist() == target == b.tokens[row, pos + 1].tolist()
        assert b.kinds[row, pos].tolist() == list(range(len(target)))
    s = sample_longgen_batch(random.Random(0), LongGenConfig(), 8, V)
    assert s.tokens.shape[1] <= LongGenConfig().seq_len and not s.induction


def test_task_config_refuses_what_cannot_fit():
    with pytest.raises(ValueError, match="chunk_len"):
        LongGenConfig(chunk_len=20)
    with pytest.raises(ValueError, match="one name each"):
        LongGenConfig(max_chunks=20)
    with pytest.raises(ValueError, match="positions"):
        LongGenConfig(chunk_len=96)
    with pytest.raises(ValueError, match="cannot ask"):
        make_longgen_prompt(random.Random(0), LongGenConfig(), 1, 5, V)
    with pytest.raises(ValueError, match="form must be one of pair, relay"):
        LongGenConfig(form="triple")
    with pytest.raises(ValueError, match="1..48 in form relay"):
        LongGenConfig(form="relay", max_chunks=13, questions=8)
    with pytest.raises(ValueError, match="probabilities"):
        LongGenConfig(form="relay", bar_object=1.5)
    assert LongGenConfig(form="relay").seq_len == 1 + 12 * 64 + 18 + 4 * 16 + 1 <= MAX_POSITIONS


def test_mode_parsing():
    assert parse_decode_modes("dense, quest@64,retro@128,retro@128:w4") == [
        DecodeMode("dense"), DecodeMode("quest", 64), DecodeMode("retro", 128), DecodeMode("retro", 128, 4)]
    assert [str(DecodeMode.parse(t)) for t in ("dense", "quest@64", "retro@32:w2")] == ["dense", "quest@64", "retro@32:w2"]
    assert DecodeMode("retro", 64, 2).generate_args(1) == {
        "decode": "retro", "budget_tokens": 64, "dense_layers": 1, "retro_window": 2}
    assert parse_decode_modes("retrieval@0,retrieval@10:s16:w32,retrieval@5:w64") == [
        DecodeMode("retrieval", k=0), DecodeMode("retrieval", k=10, sink=16, recent=32),
        DecodeMode("retrieval", k=5, recent=64)]
    assert str(DecodeMode.parse("retrieval@10:s16:w32")) == "retrieval@10:s16:w32"
    assert DecodeMode("retrieval", k=10, sink=16, recent=32).generate_args(1) == {
        "decode": "retrieval", "retrieval_k": 10, "sink_tokens": 16, "window_tokens": 32}
    for bad, message in [("retrieval", "needs its k"), ("retrieval@-1", "at least 0"), ("retrieval@5:x3", ":sSINK"),
                         ("retrieval@5:s1:s2", "once each"), ("retrieval@5:sx", "not a whole number")]:
        with pytest.raises(ValueError, match=message):
            parse_decode_modes(bad)
    for bad, message in [("nope", "unknown decode mode"), ("full", "unknown decode mode"), ("dense@64", "no budget"),
                         ("quest", "needs a budget"), ("retro", "needs a budget"), ("quest@x", "not a whole number"),
                         ("quest@0", "at least 1"), ("quest@64:w2", "quest takes no window"), ("retro@64:2", "written :wN"),
                         ("retro@64:w0", "at least 1"), ("retro@64:wx", "not a whole number"), ("", "no modes"),
                         ("dense,dense", "twice")]:
        with pytest.raises(ValueError, match=message):
            parse_decode_modes(bad)


@pytest.fixture(scope="module")
def engine():
    from services.engine import Engine

    return Engine.load(COMMITTED_LONGGEN_MODEL, device="cpu", dtype=torch.float32)


def test_committed_model_dense_answers_and_quest_over_every_page_is_dense(engine):
    prompts = longgen_heldout(1, 3)
    # every page (the prompt and the generation are < 1024 tokens), every layer sparse
    dense, quest = evaluate_decode_modes(engine, parse_decode_modes("dense,quest@1024"), prompts, dense_layers=0,
                                         progress=False)
    assert dense.accuracy() >= 0.9, dense.by_answer()
    assert quest.generations == dense.generations
    assert len(dense.by_answer()) == 16


def test_retrieval_of_every_offloaded_key_answers_as_dense_and_the_static_set_alone_does_not(engine):
    prompts = longgen_heldout(1, 2)
    dense, every, static = evaluate_decode_modes(
        engine, parse_decode_modes("dense,retrieval@1024:s16:w32,retrieval@0:s16:w32"), prompts, progress=False)
    assert every.generations == dense.generations
    assert static.accuracy() < dense.accuracy()


def test_the_cli_hands_the_index_host_dtype_to_the_eval(monkeypatch, capsys):
    """``--index-host-dtype`` reaches ``run_longgen_eval``, whose engine holds retrieval K/V so (bench/quality/README.md
    measures bfloat16's accuracy: the float32 figures); tests/engine/decode/test_retrieval.py checks the engine."""
    from loadgen.quality import longgen_eval

    seen = {}

    def run(*args, **kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(longgen_eval, "run_longgen_eval", run)
    for flags, dtype in (([], "float32"), (["--index-host-dtype", "bfloat16"], "bfloat16")):
        assert tessera(["quality", "eval", "--task", "longgen", "--prompts", "1", "--json", *flags]) == 0
        assert seen["index_host_dtype"] == dtype
    capsys.readouterr()


def test_each_mode_reports_the_pages_its_steps_read_and_retro_the_pages_it_corrected_with(engine):
    dense, quest, retro = evaluate_decode_modes(engine, parse_decode_modes("dense,quest@64,retro@64"),
                                                longgen_heldout(1, 1), progress=False)
    d, q, r = dense.as_json(), quest.as_json(), retro.as_json()
    assert d["decode_steps"] == dense.pages["steps"] > 0 and d["pages_read_per_step"] == d["pages_visible_per_step"]
    assert d["pages_corrected_per_step"] == 0 and q["pages_corrected_per_step"] == 0
    assert 0 < q["pages_read_per_step"] < q["pages_visible_per_step"]
    assert 0 < r["pages_read_per_step"] < r["pages_visible_per_step"] and r["pages_corrected_per_step"] > 0


def test_modes_the_engine_cannot_run_are_refused_before_any_runs(engine):
    with pytest.raises(ValueError, match=r"mode quest@8: the engine cannot run it: budget_tokens"):
        evaluate_decode_modes(engine, parse_decode_modes("dense,quest@8"), longgen_heldout(1, 1), progress=False)
    with pytest.raises(ValueError, match=r"mode quest@64: the engine cannot run it: dense_layers"):
        evaluate_decode_modes(engine, parse_decode_modes("quest@64"), longgen_heldout(1, 1), dense_layers=9,
                              progress=False)


def test_cli_json_and_plot(capsys, tmp_path):
    png = tmp_path / "curve.png"
    rc = tessera(["quality", "eval", "--task", "longgen", "--prompts", "1", "--questions", "8",
                  "--modes", "dense,quest@64", "--json", "--plot", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["dense", "quest@64"]
    assert out["quest@64"]["policy"] == "quest" and out["quest@64"]["budget_tokens"] == 64
    assert len(out["dense"]["by_answer"]) == 8 and out["dense"]["accuracy"] >= 0.875
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_rejects_flags_of_the_other_task(capsys):
    assert tessera(["quality", "eval", "--task", "longgen", "--modes", "quest"]) == 2
    assert tessera(["quality", "eval", "--task", "longgen", "--reference"]) == 2
    assert tessera(["quality", "eval", "--task", "longgen", "--questions", "17"]) == 2
    assert tessera(["quality", "eval", "--dense-layers", "1"]) == 2
    assert tessera(["quality", "eval", "--index-host-dtype", "bfloat16"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("model, form", [(COMMITTED_LONGGEN_MODEL, "pair"), (COMMITTED_RELAY_MODEL, "relay")])
def test_committed_model_is_a_half_precision_hf_llama_made_by_a_recorded_command(model, form):
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float16"
    assert cfg["vocab_size"] == V.size and cfg["max_position_embeddings"] >= LongGenConfig(form=form).seq_len
    summary = json.loads((model / "training.json").read_text())
    assert summary["config"]["task"] == "longgen" and summary["final_heldout"]["greedy"]["answers"] >= 0.95
    assert summary["config"].get("form", "pair") == form
    assert summary["command"] in (model / "README.md").read_text()


@pytest.fixture(scope="module")
def relay_engine():
    from services.engine import Engine

    return Engine.load(COMMITTED_RELAY_MODEL, device="cpu", dtype=torch.float32)


def test_relay_model_answers_densely_and_retro_recovers_what_quest_loses(relay_engine):
    """The relay task is the one where Retro's corrections reach answers (loadgen/quality/README.md): at a budget of
    8 pages Quest loses answers whose name step missed the fact's page, and Retro, correcting the name step with the
    page the next step loads, gets most of them back. A budget covering every page is dense."""
    prompts = longgen_heldout(1, 8, LongGenConfig(questions=14, form="relay"))
    dense, every, quest, retro = evaluate_decode_modes(
        relay_engine, parse_decode_modes("dense,retro@1024,quest@128,retro@128"), prompts, progress=False)
    assert dense.accuracy() >= 0.95 and every.generations == dense.generations
    assert len(dense.adj) == 8 and dense.as_json()["adj_accuracy"] >= 0.95
    lost, recovered = dense.accuracy() - quest.accuracy(), retro.accuracy() - quest.accuracy()
    assert lost >= 0.1 and recovered >= lost / 3, (dense.accuracy(), quest.accuracy(), retro.accuracy())


def test_cli_form_relay_evaluates_the_committed_relay_model(monkeypatch, capsys):
    from loadgen.quality import longgen_eval

    seen = {}

    def run(model_dir, *args, **kwargs):
        seen.update(kwargs, model=model_dir)
        return []

    monkeypatch.setattr(longgen_eval, "run_longgen_eval", run)
    assert tessera(["quality", "eval", "--task", "longgen", "--form", "relay", "--prompts", "1", "--json"]) == 0
    assert seen["form"] == "relay" and seen["model"] == str(COMMITTED_RELAY_MODEL)
    assert tessera(["quality", "eval", "--task", "longgen", "--prompts", "1", "--json"]) == 0
    assert seen["form"] == "pair" and seen["model"] == str(COMMITTED_LONGGEN_MODEL)
    assert tessera(["quality", "eval", "--form", "relay"]) == 2
    with pytest.raises(SystemExit):
        tessera(["quality", "eval", "--task", "longgen", "--form", "triple"])
    assert "error" in capsys.readouterr().err
