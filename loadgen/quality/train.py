"""Train a quality model (task coref or longgen) and write it as a Hugging Face Llama directory.

    python -m loadgen.quality.train -o DIR [--task coref|longgen --steps N --batch 256 --lr 2e-3 --seed S --device cuda]
    tessera quality train -o DIR ...            (same flags)

Data is generated on the fly by DataLoader workers (one ``random.Random`` stream per worker, seeded
from ``--seed``); 40% of batches are induction data. Held-out accuracy (what ``objectives.py`` says
per task: coref's full prefill and full reuse per question type, longgen's teacher-forced names,
objects and end) is logged every ``--eval-every`` steps, and training stops once full prefill
reaches ``--target`` on every column. Imports only torch, numpy, safetensors, tokenizers and tqdm,
so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from loadgen.quality.config import TrainConfig, add_train_args, config_from_args
from loadgen.quality.model import TinyLlama, load_hf, save_hf
from loadgen.quality.objectives import Objective, objective
from loadgen.quality.tasks import bar_mask
from loadgen.quality.vocab import vocab


class Batches(torch.utils.data.IterableDataset):
    """Endless training batches; each worker draws from its own seeded stream."""

    def __init__(self, cfg: TrainConfig, obj: Objective):
        self.cfg, self.obj = cfg, obj

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(f"{self.obj.name}-train-{self.cfg.seed}-{info.id if info else 0}")
        v = vocab()
        while True:
            if rng.random() < self.cfg.induction:
                b = self.obj.induction(rng, self.cfg.batch, v)
            else:
                b = self.obj.batch(rng, self.cfg.batch, v)
            barred = torch.from_numpy(b.barred) if b.barred is not None else torch.empty(0, dtype=torch.long)
            yield torch.from_numpy(b.tokens), torch.from_numpy(b.targets), b.induction, barred


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10%."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def _optimizer(model: TinyLlama, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No decay on norms (1-d weights); decay pulls them toward 0, not toward their init of 1.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    keep = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=cfg.device.startswith("cuda"))


def evaluate(model: TinyLlama, prompts, obj: Objective) -> dict[str, dict[str, float]]:
    model.eval()
    out = obj.evaluate(model, prompts)
    model.train()
    return out


def _fmt(acc: dict[str, dict[str, float]]) -> str:
    return "  ".join(f"{mode} " + "/".join(f"{a:.3f}" for a in kinds.values()) for mode, kinds in acc.items())


def train(cfg: TrainConfig, command: str = "") -> dict:
    """Run training; returns the summary also written to ``<out>/training.json``."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    obj = objective(cfg.task, cfg.form, cfg.bar_object)
    device = torch.device(cfg.device)
    model = TinyLlama(cfg.model_config())
    if cfg.init:
        model.load_state_dict(load_hf(cfg.init).state_dict())
    model = model.to(device)
    opt = _optimizer(model, cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    workers = cfg.workers if cfg.workers >= 0 else (min(8, max(1, (os.cpu_count() or 2) - 1)) if cuda else 1)
    loader = torch.utils.data.DataLoader(
        Batches(cfg, obj), batch_size=None, num_workers=workers, pin_memory=cuda,
        prefetch_factor=4 if workers else None, persistent_workers=bool(workers),
    )
    heldout = obj.heldout(cfg.seed, cfg.eval_prompts)
    history: list[dict] = []
    losses = {obj.name: 0.0, "induction": 0.0}
    counts = {obj.name: 0, "induction": 0}
    start = time.time()
    step = 0
    bar = tqdm(total=cfg.steps, desc="train", dynamic_ncols=True, file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 15.0)
    tqdm.write(f"model: {model.num_parameters() / 1e6:.2f}M parameters, {cfg.model_config()}", file=sys.stderr)
    tqdm.write(f"held-out accuracy columns: {obj.columns}", file=sys.stderr)
    for tokens, targets, is_induction, barred in loader:
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        mask = bar_mask(barred.to(device), tokens.shape[1]) if barred.numel() else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(tokens, mask)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        kind = "induction" if is_induction else obj.name
        losses[kind] += loss.item()
        counts[kind] += 1
        step += 1
        bar.update(1)
        done = step >= cfg.steps
        if step % cfg.eval_every == 0 or done:
            acc = evaluate(model, heldout, obj)
            avg = {k: losses[k] / max(1, counts[k]) for k in losses}
            history.append({"step": step, "seconds": round(time.time() - start, 1), "loss": avg, "accuracy": acc})
            bar.set_postfix(loss=f"{avg[obj.name]:.3f}", ind=f"{avg['induction']:.3f}", worst=f"{min(acc['full'].values()):.3f}")
            tqdm.write(f"step {step:5d}  loss {obj.name} {avg[obj.name]:.4f} induction {avg['induction']:.4f}  {_fmt(acc)}",
                       file=sys.stderr)
            losses = dict.fromkeys(losses, 0.0)
            counts = dict.fromkeys(counts, 0)
            if cfg.time_limit and time.time() - start > cfg.time_limit:
                tqdm.write(f"time limit of {cfg.time_limit:.0f} s reached: stopping at step {step}", file=sys.stderr)
                done = True
            if obj.reached(acc, cfg.target):
                tqdm.write(f"full-prefill accuracy >= {cfg.target} on every column: stopping at step {step}", file=sys.stderr)
                done = True
        if done:
            break
    bar.close()
    seconds = time.time() - start
    out = save_hf(model, cfg.out, cfg.save_dtype)
    # The saved (fp16/bf16) weights are what everyone uses: measure those, in fp32.
    saved = load_hf(out, device=str(device))
    final = obj.final(saved, heldout)
    summary = {
        "command": command, "config": asdict(cfg), "parameters": model.num_parameters(), "steps": step,
        "seconds": round(seconds, 1), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "final_heldout": final, "history": history,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(obj.readme(summary))
    tqdm.write(f"saved {out} after {step} steps ({seconds:.0f} s): {_fmt(final)}", file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m loadgen.quality.train", description=__doc__.split("\n")[0])
    cfg = config_from_args(add_train_args(p).parse_args(argv))
    train(cfg, command="python -m loadgen.quality.train " + shlex.join(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
