"""Training configuration and its command-line flags (torch-free, so ``tessera --help`` stays fast)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loadgen.quality.tasks import FORMS

TASKS = ("coref", "longgen")  # what each trains on: objectives.py (which imports torch; this module does not)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    out: str
    task: str = "coref"            # one of TASKS
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0          # 0: 2.5 x hidden (640 for hidden 256: 2.9M parameters)
    steps: int = 4000              # length of the lr schedule; training usually stops earlier
    batch: int = 256
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.1
    induction: float = 0.4         # fraction of batches that are induction data
    seed: int = 0
    device: str = "cpu"
    workers: int = -1              # DataLoader workers; -1: min(8, cpus - 1) on cuda, 1 on cpu
    eval_every: int = 250
    eval_prompts: int = 1000
    target: float = 0.999          # stop once full-prefill accuracy reaches this on every type
    time_limit: float = 0.0        # seconds of training after which to stop and save anyway; 0: none
    save_dtype: str = "float16"
    init: str = ""                 # a model directory of the same shape whose weights training starts from; "": random
    form: str = "pair"             # longgen: how each answer is laid out (tasks.FORMS)
    bar_object: float = 0.9        # longgen relay: chance an object step is barred from the chunks (tasks.longgen_batch)

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("an output directory is required")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if not 0 <= self.bar_object <= 1:
            raise ValueError(f"bar_object is a probability, got {self.bar_object}")
        if self.form != "pair" and self.task != "longgen":
            raise ValueError(f"form {self.form!r} is longgen's (--task longgen); {self.task} has none")
        if min(self.layers, self.hidden, self.heads, self.kv_heads) < 1 or self.intermediate < 0:
            raise ValueError("model sizes must be positive")
        if self.steps < 1 or self.batch < 1 or self.eval_every < 1 or self.eval_prompts < 1 or self.warmup < 0:
            raise ValueError("steps, batch, eval_every and eval_prompts must be positive (warmup >= 0)")
        if not 0 <= self.induction < 1:
            raise ValueError(f"induction fraction must be in [0, 1), got {self.induction}")
        if not (self.lr > 0 and 0 < self.target <= 1 and self.time_limit >= 0):
            raise ValueError("lr must be positive, target in (0, 1] and time_limit >= 0")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"save_dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")

    def model_config(self):
        from loadgen.quality.model import ModelConfig
        from loadgen.quality.vocab import vocab

        return ModelConfig(
            vocab_size=vocab().size, hidden=self.hidden, layers=self.layers, heads=self.heads,
            kv_heads=self.kv_heads, intermediate=self.intermediate or int(2.5 * self.hidden),
        )


_INT_FLAGS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "steps", "batch", "warmup",
              "seed", "workers", "eval_every", "eval_prompts")
_FLOAT_FLAGS = ("lr", "weight_decay", "induction", "target", "time_limit", "bar_object")
_STR_FLAGS = ("task", "save_dtype", "init", "form")


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("-o", "--out", required=True, help="output directory (Hugging Face Llama format)")
    defaults = TrainConfig(out="-")
    p.add_argument("--task", default=defaults.task, choices=TASKS, help=f"what to train on (default {defaults.task})")
    for name in _INT_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in _FLOAT_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--save-dtype", default=defaults.save_dtype, choices=("float16", "bfloat16", "float32"))
    p.add_argument("--init", default=defaults.init, metavar="DIR",
                   help="start from this model directory's weights (same shape) instead of random ones")
    p.add_argument("--form", default=defaults.form, choices=tuple(FORMS),
                   help="longgen: how each answer is laid out (pair: N O; relay: N IT A O, facts A N O .)")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f: getattr(args, f) for f in _STR_FLAGS + _INT_FLAGS + _FLOAT_FLAGS}
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return TrainConfig(out=args.out, device=device, **fields)


def command_line(cfg: TrainConfig) -> str:
    """A command that reproduces ``cfg``: the output, the device and every flag that differs from its default."""
    import shlex

    defaults = TrainConfig(out="-")
    parts = ["tessera", "quality", "train", "-o", cfg.out, "--device", cfg.device]
    for name in _STR_FLAGS + _INT_FLAGS + _FLOAT_FLAGS:
        value = getattr(cfg, name)
        if value != getattr(defaults, name):
            parts += ["--" + name.replace("_", "-"), str(value)]
    return shlex.join(parts)
