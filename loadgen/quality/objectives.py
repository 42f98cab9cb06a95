"""What ``train.py`` trains on, task by task: batches, held-out prompts, how they are scored while training
and once saved, and the README written beside the checkpoint. The training loop knows no task.

Like ``train.py``, this imports only torch, numpy and the testbed's own torch-free modules.
"""

from __future__ import annotations

import random
from typing import Protocol

from loadgen.quality.config import TASKS
from loadgen.quality.reference import longgen_greedy, longgen_teacher_forced, reference_tally
from loadgen.quality.tasks import (Batch, LongGenConfig, TaskConfig, heldout_prompts, induction_batch, longgen_heldout,
                                   sample_coref_batch, sample_longgen_batch)
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
    columns = "name/object/end"

    def __init__(self):
        self.task = LongGenConfig()

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
        right = [p.answers_right(g) for p, g in zip(prompts, longgen_greedy(model, prompts))]
        k = len(right[0])
        out["greedy"] = {
            "answers": sum(map(sum, right)) / (k * len(right)),
            "prompt_all_right": sum(map(all, right)) / len(right),
        }
        out["greedy_by_answer"] = {str(i + 1): sum(r[i] for r in right) / len(right) for i in range(k)}
        return out

    def readme(self, s: dict) -> str:
        c, t, f = s["config"], self.task, s["final_heldout"]
        by_answer = " ".join(f"{a:.3f}" for a in f["greedy_by_answer"].values())
        return f"""# Longgen quality model

Trained by `loadgen/quality/train.py` on the synthetic longgen task (`loadgen/quality/tasks.py`): a
context of {t.max_chunks} chunks of {t.chunk_len} tokens with {t.facts_per_chunk} facts `NAME OBJ .` each
(and distractors `NAME arrives .`), then `Q N_1 .. N_{t.questions} .`, answered in one generation
`N_1 O_1 .. N_{t.questions} O_{t.questions} <eos>`. Read it with `Engine.load` or
`transformers.LlamaForCausalLM.from_pretrained`; `tessera quality eval --task longgen` measures the
decode policies on it.

Made with (seed {c['seed']}, on {s['device']}):

    {s['command']}

{s['parameters']:,} parameters (Llama, {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads,
{c['kv_heads']} KV heads, RoPE theta 10000), {c['save_dtype']} weights; {s['steps']} steps of batch
{c['batch']} in {s['seconds']} s ({c['induction']:.0%} induction batches).{_started_from(c)}

Held-out accuracy of the saved weights ({c['eval_prompts']} prompts of the eval shape, seed {c['seed']}):

- teacher-forced (argmax over the vocabulary): names {f['full']['name']:.4f}, objects {f['full']['object']:.4f},
  end {f['full']['end']:.4f};
- greedy generation (dense attention, in fp32): answers {f["greedy"]["answers"]:.4f}, prompts with every
  answer right {f['greedy']['prompt_all_right']:.4f}; by answer position 1..{t.questions}: {by_answer}.

`training.json` holds the full configuration and the accuracy history.
"""


def _started_from(c: dict) -> str:
    return f" Started from the weights of `{c['init']}`." if c.get("init") else ""


def objective(name: str) -> Objective:
    """The objective of task ``name`` (one of config.TASKS)."""
    if name == "coref":
        return CorefObjective()
    if name == "longgen":
        return LongGenObjective()
    raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
