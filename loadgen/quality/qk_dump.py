"""Post-RoPE queries and keys of the quality models, per (layer, KV head): the data the attention index is
measured on (services/index, tests/index, bench/index).

What a dump holds, for one task's held-out prompts run teacher-forced through the plain-torch model
(``model.py``, fp32 on the CPU):

- ``keys``     the keys of every prompt position (``<bos>``, the chunks, the question suffix);
- ``queries``  the prefill queries at the same positions, of every query head that reads this KV head
  (GQA group j*g..j*g+g-1): the index's training queries;
- ``heldout``  the queries of the answer positions (the teacher-forced generation, which the committed
  models get right ~all the time, so it equals greedy decode): the decode-time queries that search the
  index, never seen by its build. The RetrievalAttention paper (Figure 9) finds decode queries in the
  distribution of prefill queries and far from keys; that gap is what the index is for.

NOTE: one testbed prompt holds ~800 positions (longgen) or ~120 (coref), far fewer than the contexts the
index is for, so a dump pools many prompts: each prompt runs alone at its own positions 0..T-1 and its
keys are stacked after the previous prompt's. A held-out query of prompt p thus searches the keys of every
pooled prompt, and its exact top-k may hold keys of other prompts (the ``<bos>`` key is the same in every
prompt, and a name token at the same position is the same key in layer 0): recall is measured against the
exact inner products of the pool, with ties counted as hits (bench/index/recall.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loadgen.quality.model import TinyLlama, apply_rope, load_hf, rope_tables
from loadgen.quality.tasks import (LongGenConfig, TaskConfig, coref_batch, heldout_prompts, longgen_batch,
                                   longgen_heldout)
from loadgen.quality.vocab import vocab

TASKS = ("longgen", "coref")
_MODEL_DIRS = {"longgen": "model_longgen", "coref": "model"}


@dataclass(frozen=True, slots=True)
class HeadQK:
    """One (layer, KV head) of a dump, float32 and C-contiguous.

    keys ``[N, D]``; queries ``[M, D]`` (M = group x N: the group's query heads stacked head by head, each
    in the keys' order); heldout ``[G, D]`` (the group's answer-position queries, head by head).
    """

    layer: int
    kv_head: int
    keys: np.ndarray
    queries: np.ndarray
    heldout: np.ndarray


def model_dir(task: str) -> Path:
    """The committed model of ``task`` (longgen: ``model_longgen``, coref: ``model``)."""
    if task not in _MODEL_DIRS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return Path(__file__).resolve().parent / _MODEL_DIRS[task]


def _sequences(task: str, prompts: int, seed: int) -> list[tuple[list[int], int]]:
    """Per prompt: its full teacher-forced token ids and the length of its prompt part (the keys)."""
    v = vocab()
    if task == "longgen":
        cfg = LongGenConfig()
        batch = longgen_batch(longgen_heldout(seed, prompts, cfg), v)
        # the first target token is predicted from the suffix's last position: the prompt ends there
        starts = [int(np.flatnonzero(row != -100)[0]) + 1 for row in batch.targets]
    else:
        cfg = TaskConfig()
        batch = coref_batch(heldout_prompts(seed, prompts, cfg), cfg, v)
        starts = [1 + cfg.chunk_len * cfg.max_chunks] * prompts   # questions follow the chunks
    out = []
    for row, start in zip(batch.tokens, starts):
        length = int(np.flatnonzero(row != v.pad)[-1]) + 1
        out.append((row[:length].tolist(), start))
    return out


@torch.no_grad()
def _layer_qk(model: TinyLlama, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: post-RoPE q ``[H, T, D]`` and k ``[Hkv, T, D]`` of one sequence (the model's own forward,
    with each attention's projections read off on the way)."""
    cfg = model.cfg
    ids = torch.tensor([tokens], dtype=torch.long)
    cos, sin = rope_tables(cfg, torch.arange(len(tokens)))
    x = model.model.embed_tokens(ids)
    out = []
    for layer in model.model.layers:
        attn, h = layer.self_attn, layer.input_layernorm(x)
        T = len(tokens)
        q = attn.q_proj(h).view(1, T, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(1, T, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        out.append((apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]))
        x = layer(x, cos, sin, None)
    return out


def dump_qk(task: str = "longgen", prompts: int = 32, seed: int = 0, directory: str | Path | None = None,
            spread: bool = False) -> list[HeadQK]:
    """Queries and keys of ``prompts`` held-out prompts of ``task`` (stream ``seed``), one ``HeadQK`` per
    (layer, KV head) in layer-major order. ``directory`` defaults to the task's committed model.

    ``spread``: every prompt still runs at positions 0..T-1, then its queries and keys are rotated on by the
    prompt's offset in the pool (the sum of the earlier prompts' lengths), as if the prompts were chunks of
    one long context computed apart and placed at their offsets (Tessera's reused chunks are). Scores within a
    prompt are unchanged (RoPE is relative); no two keys of the pool then share a position, so layer 0 holds
    no exact copies (without it, a word at the same position in two prompts is the same layer-0 key)."""
    if prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {prompts}")
    model = load_hf(directory if directory is not None else model_dir(task))
    cfg = model.cfg
    group = cfg.heads // cfg.kv_heads
    keys: dict[tuple[int, int], list[np.ndarray]] = {}
    queries: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    heldout: dict[tuple[int, int], list[list[np.ndarray]]] = {}
    offset = 0
    for tokens, start in _sequences(task, prompts, seed):
        cos, sin = rope_tables(cfg, torch.tensor([offset]))
        offset += len(tokens) if spread else 0
        for layer, (q, k) in enumerate(_layer_qk(model, tokens)):
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)     # rotation by 0 when not spread
            for j in range(cfg.kv_heads):
                key = (layer, j)
                keys.setdefault(key, []).append(k[j, :start].numpy())
                heads = q[j * group:(j + 1) * group]                       # [g, T, D]
                queries.setdefault(key, [[] for _ in range(group)])
                heldout.setdefault(key, [[] for _ in range(group)])
                for i in range(group):
                    queries[key][i].append(heads[i, :start].numpy())
                    heldout[key][i].append(heads[i, start:].numpy())

    def stack(parts: list[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    return [HeadQK(layer, j, stack(keys[(layer, j)]), stack([stack(p) for p in queries[(layer, j)]]),
                   stack([stack(p) for p in heldout[(layer, j)]]))
            for layer in range(cfg.layers) for j in range(cfg.kv_heads)]
