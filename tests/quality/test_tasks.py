"""The coref task says what the issue says: layout, fact kinds, IT resolution, fresh draws, batches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadgen.quality.tasks import IGNORE, KINDS, TaskConfig, coref_batch, heldout_prompts, induction_batch, make_prompt
from loadgen.quality.vocab import FILLERS, NAMES, OBJECTS, build_tokenizer, vocab

V = vocab()


def solve(tokens: list[int]) -> dict[int, int]:
    """An independent reader of a prompt's text: NAME -> OBJ by the task's rules alone."""
    names, objects = set(V.names), set(V.objects)
    answer: dict[int, int] = {}
    last_name = None
    for i, t in enumerate(tokens):
        if t in names:
            last_name = t
            if i + 1 < len(tokens) and tokens[i + 1] in objects:
                answer[t] = tokens[i + 1]          # NAME OBJ .
        elif t == V.pronoun:
            assert last_name is not None, "IT with no name before it"
            answer[last_name] = tokens[i + 1]      # IT OBJ .: the most recent name
    return answer


def test_vocabulary_is_the_issues():
    assert (len(NAMES), len(OBJECTS), len(FILLERS)) == (64, 96, 100)
    assert V.size == 268 and len(set(V.words)) == V.size
    assert V.words[V.pronoun] == "IT" and V.words[V.verb] == "arrives"


def test_tokenizer_round_trips_a_prompt():
    tok = build_tokenizer()
    p = heldout_prompts(3, 1)[0]
    ids = [V.bos] + [t for c in p.chunks for t in c] + [V.question, p.facts[0].name]
    text = V.decode(ids)
    assert tok.encode(text).ids == ids == V.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="not in the coref vocabulary"):
        V.encode("Ada owns a spaceship")


@pytest.mark.parametrize("seed,cross_gap", [(s, 0) for s in range(4)] + [(7, 3)])
def test_prompt_layout_and_facts(seed, cross_gap):
    cfg = TaskConfig(cross_gap=cross_gap)
    rng = random.Random(seed)
    for n_chunks in range(1, cfg.max_chunks + 1):
        p = make_prompt(rng, cfg, n_chunks, V)
        assert len(p.chunks) == n_chunks and all(len(c) == cfg.chunk_len for c in p.chunks)
        flat = [t for c in p.chunks for t in c]
        named = [t for t in flat if t in set(V.names)]
        assert len(named) == len(set(named)) == len(p.facts), "every name has exactly one fact"
        assert len({f.obj for f in p.facts}) == len(p.facts)
        assert solve(flat) == {f.name: f.obj for f in p.facts}
        for f in p.facts:
            chunk = p.chunks[f.chunk]
            if f.kind == "cross":
                before = p.chunks[f.chunk - 1]
                it = chunk.index(V.pronoun)
                assert before[-3:] == (f.name, V.verb, V.stop) and chunk[it : it + 3] == (V.pronoun, f.obj, V.stop)
                assert it <= cross_gap and all(t in set(V.fillers) for t in chunk[:it])
            elif f.kind == "local":
                start = chunk.index(f.name)
                end = chunk.index(f.obj)
                assert chunk[start + 1 : start + 3] == (V.verb, V.stop) and chunk[end - 1] == V.pronoun
                assert all(t in set(V.fillers) for t in chunk[start + 3 : end - 1])
            else:
                i = chunk.index(f.name)
                assert chunk[i + 1 : i + 3] == (f.obj, V.stop)
        assert len(set(p.questions)) == len(p.questions) == min(cfg.questions, len(p.facts))


def test_heldout_prompts_are_fixed_by_seed_and_drawn_fresh():
    a, b, c = heldout_prompts(1, 50), heldout_prompts(1, 50), heldout_prompts(2, 50)
    assert a == b and a != c
    gapped = heldout_prompts(1, 50, TaskConfig(cross_gap=3))
    assert gapped != a and any(p.chunks[c][0] in set(V.fillers) for p in gapped for c in range(1, 5)
                               if any(f.kind == "cross" and f.chunk == c for f in p.facts))
    assert len({p.facts[0].name for p in a}) > 20, "names must vary across prompts"
    kinds = [f.kind for p in a for f in p.question_facts()]
    assert all(kinds.count(k) > 20 for k in KINDS)


def test_coref_batch_puts_loss_on_answers_only():
    cfg = TaskConfig()
    prompts = heldout_prompts(4, 6)
    b = coref_batch(prompts, cfg, V)
    assert b.tokens.shape == b.targets.shape == (6, cfg.seq_len)
    for row, p in enumerate(prompts):
        pos = np.flatnonzero(b.targets[row] != IGNORE)
        facts = p.question_facts()
        assert len(pos) == len(facts)
        for t, f in zip(pos, facts):
            assert b.tokens[row, t - 1] == V.question and b.tokens[row, t] == f.name
            assert b.targets[row, t] == b.tokens[row, t + 1] == f.obj
            assert KINDS[b.kinds[row, t]] == f.kind


def test_induction_batch_repeats_a_segment_and_scores_the_repeat():
    cfg = TaskConfig()
    b = induction_batch(random.Random(0), cfg, 16, V)
    for row in range(16):
        seq = b.tokens[row][b.tokens[row] != V.pad]
        n = (len(seq) - 1) // 2
        assert seq[0] == V.bos and np.array_equal(seq[1 : n + 1], seq[n + 1 :])
        pos = np.flatnonzero(b.targets[row] != IGNORE)
        assert pos.tolist() == list(range(n + 1, 2 * n))
        assert np.array_equal(b.targets[row, pos], b.tokens[row, pos + 1])


def test_task_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="chunk_len"):
        TaskConfig(chunk_len=10)
    with pytest.raises(ValueError, match="max_chunks"):
        TaskConfig(max_chunks=0)
