"""What ``train.py`` trains on, task by task: batches, held-out prompts, how they are scored while training
and once saved, and the README written beside the checkpoint. The training loop knows no task.

Like ``train.py``, this imports only torch, numpy and the testbed's own torch-free modules.
"""

from __future__ import annotations

import random
from typing import Protocol

from loadgen.quality.config import TASKS
from loadgen.quality.reference import longgen_greedy, longgen_teacher_forced, reference_tally
from loadgen.quality.tasks import (FORMS, Batch, LongGenConfig, TaskConfig, heldout_prompts, induction_batch,
                                   longgen_heldout, sample_coref_batch, sample_longgen_batch)
from loadgen.quality.vocab import Vocab


class Objective(Protocol):
    """What the training loop asks of a task. ``task``: its shape (a ``TaskConfig`` or ``LongGenConfig``);
    ``columns``: the names of the accuracies ``evaluate`` logs under ``"full"``."""

    name: str
    columns: str

    def batch(self, rng: random.Random, size: int, v: Vocab) -> Batch: ...
    def induction(self, rng: random.Random, size: int, v: Vocab) -> Batch: ...
    def heldout(self, seed: int, n: int) -> list: ...
    def evaluate(self, model, prompts) -> dict[str, dict[str, float]]: ...
    def reached(self, acc: dict[str, dict[str, float]], target: float) -> bool: ...
    def final(self, model, prompts) -> dict[str, dict[str, float]]: ...
    def readme(self, summary: dict) -> str: ...


class CorefObjective:
    """The coref task (tasks.py): questions answered from the prompt's chunks, with and without chunk reuse."""

    name = "coref"
    columns = "direct/local/cross"

    def __init__(self):
        self.task = TaskConfig()

    def batch(self, rng: random.Random, size: int, v: Vocab) -> Batch:
        return sample_coref_batch(rng, self.task, size, v)

    def induction(self, rng: random.Random, size: int, v: Vocab) -> Batch:
        return induction_batch(rng, self.task, size, v)

    def heldout(self, seed: int, n: int) -> list:
        return heldout_prompts(seed, n, self.task)

    def evaluate(self, model, prompts) -> dict[str, dict[str, float]]:
        return {
            "full": reference_tally(model, prompts, self.task).accuracy(),
            "reuse": reference_tally(model, prompts, self.task, reuse=True).accuracy(),
        }

    def reached(self, acc: dict[str, dict[str, float]], target: float) -> bool:
        return min(acc["full"].values()) >= target

    def final(self, model, prompts) -> dict[str, dict[str, float]]:
        out = self.evaluate(model, prompts)
        out["reuse_bos_in_first_chunk"] = reference_tally(model, prompts, self.task, reuse=True,
                                                          bos_own_chunk=False).accuracy()
        return out

    def readme(self, s: dict) -> str:
        c = s["config"]
        rows = "\n".join(f"| {m} | " + " | ".join(f"{a:.4f}" for a in acc.values()) + " |"
                         for m, acc in s["final_heldout"].items())
        return f"""# Coref quality model

Trained by `loadgen/quality/train.py` (issue #7) on the synthetic coref task; read it with
`Engine.load` or `transformers.LlamaForCausalLM.from_pretrained`.

Made with (seed {c['seed']}, on {s['device']}):

    {s['command']}

{s['parameters']:,} parameters (Llama, {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads,
{c['kv_heads']} KV heads, RoPE theta 10000), {c['save_dtype']} weights; {s['steps']} steps of batch
{c['batch']} in {s['seconds']} s ({c['induction']:.0%} induction batches).{_started_from(c)}

Held-out accuracy of the saved weights ({c['eval_prompts']} prompts of 5 chunks, seed {c['seed']};
teacher-forced, argmax over the vocabulary; `reuse` = every chunk's KV computed alone, `<bos>` its
own chunk):

| mode | direct | local | cross |
| --- | --- | --- | --- |
{rows}

`training.json` holds the full configuration and the accuracy history.
"""


class LongGenObjective:
    """The longgen task (tasks.py): K questions over a long context answered in order in one generation.
    Logged: teacher-forced accuracy of the target's names, objects and end; once saved, also greedy
    generation (dense), scored per answer as the engine eval scores it."""

    name = "longgen"

    def __init__(self, form: str = "pair", bar_object: float = 0.9):
        self.task = LongGenConfig(form=form, bar_object=bar_object)
        self.columns = "/".join((*FORMS[form], "end"))

    def batch(self, rng: random.Random, size: int, v: Vocab) -> Batch:
        return sample_longgen_batch(rng, self.task, size, v)

    def induction(self, rng: random.Random, size: int, v: Vocab) -> Batch:
        # as long as a task batch of 1..max_chunks chunks (one length a batch, so short ones cost little):
        # the longest copy as far back as the longest lookups
        t = self.task
        shorter = (t.max_chunks - rng.randint(1, t.max_chunks)) * t.chunk_len
        return induction_batch(rng, t, size, v, seq_len=t.seq_len - shorter)

    def heldout(self, seed: int, n: int) -> list:
        return longgen_heldout(seed, n, self.task)

    def evaluate(self, model, prompts) -> dict[str, dict[str, float]]:
        return {"full": longgen_teacher_forced(model, prompts)}

    def reached(self, acc: dict[str, dict[str, float]], target: float) -> bool:
        return min(acc["full"].values()) >= target

    def final(self, model, prompts) -> dict[str, dict[str, float]]:
        out = self.evaluate(model, prompts)
        generations = longgen_greedy(model, prompts)
        right = [p.answers_right(g) for p, g in zip(prompts, generations)]
        k = len(right[0])
        out["greedy"] = {
            "answers": sum(map(sum, right)) / (k * len(right)),
            "prompt_all_right": sum(map(all, right)) / len(right),
        }
        if "adj" in FORMS[self.task.form]:
            adj = [p.slots_right("adj", g) for p, g in zip(prompts, generations)]
            out["greedy"]["adj"] = sum(map(sum, adj)) / (k * len(adj))
        out["greedy_by_answer"] = {str(i + 1): sum(r[i] for r in right) / len(right) for i in range(k)}
        return out

    def readme(self, s: dict) -> str:
        c, t, f = s["config"], self.task, s["final_heldout"]
        by_answer = " ".join(f"{a:.3f}" for a in f["greedy_by_answer"].values())
        fact, answer = {"pair": ("NAME OBJ", "N_i O_i"), "relay": ("ADJ NAME OBJ", "N_i IT A_i O_i")}[t.form]
        teacher = ", ".join(f"{role} {f['full'][role]:.4f}" for role in (*FORMS[t.form], "end"))
        adj = f", the words before the names {f['greedy']['adj']:.4f}" if "adj" in f["greedy"] else ""
        flag = "" if t.form == "pair" else f" --form {t.form}"
        return f"""# Longgen quality model (form {t.form})

Trained by `loadgen/quality/train.py` on the synthetic longgen task (`loadgen/quality/tasks.py`): a
context of {t.max_chunks} chunks of {t.chunk_len} tokens with {t.facts_per_chunk} facts `{fact} .` each
(and distractors `NAME arrives .`), then `Q N_1 .. N_{t.questions} .`, answered in one generation of
`{answer}` for i = 1..{t.questions}, then `<eos>`. Read it with `Engine.load` or
`transformers.LlamaForCausalLM.from_pretrained`; `tessera quality eval --task longgen{flag}` measures the
decode policies on it.

Made with (seed {c['seed']}, on {s['device']}):

    {s['command']}

{s['parameters']:,} parameters (Llama, {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads,
{c['kv_heads']} KV heads, RoPE theta 10000), {c['save_dtype']} weights; {s['steps']} steps of batch
{c['batch']} in {s['seconds']} s ({c['induction']:.0%} induction batches).{_started_from(c)}

Held-out accuracy of the saved weights ({c['eval_prompts']} prompts of the eval shape, seed {c['seed']}):

- teacher-forced (argmax over the vocabulary), by slot: {teacher};
- greedy generation (dense attention, in fp32): answers {f["greedy"]["answers"]:.4f}, prompts with every
  answer right {f['greedy']['prompt_all_right']:.4f}{adj}; by answer position 1..{t.questions}: {by_answer}.

`training.json` holds the full configuration and the accuracy history.
"""


def _started_from(c: dict) -> str:
    return f" Started from the weights of `{c['init']}`." if c.get("init") else ""


def objective(name: str, form: str = "pair", bar_object: float = 0.9) -> Objective:
    """The objective of task ``name`` (one of config.TASKS); ``form``: longgen's answer layout (tasks.FORMS)."""
    if name == "coref":
        if form != "pair":
            raise ValueError(f"form {form!r} is longgen's; coref has none")
        return CorefObjective()
    if name == "longgen":
        return LongGenObjective(form, bar_object)
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
