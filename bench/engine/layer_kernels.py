"""Kernels one decoder layer launches (attention_inputs + finish_layer; attention and the KV write
excluded), and on a GPU what that layer costs.

    python bench/engine/layer_kernels.py                       # CPU: op counts, Triton interpreted
    python bench/engine/layer_kernels.py --model OLD_MODEL.py  # the same for another model.py (e.g. from git)
    python bench/engine/layer_kernels.py --device cuda         # GPU: profiler kernel counts, twin checks, timings

CPU: every aten op that launches a kernel on CUDA (views and allocations excluded) plus every Triton
launch, counted with a TorchDispatchMode. CUDA: one Llama-3-8B-shaped layer in bf16; kernels counted by
the torch profiler, each fused kernel checked against its twin, and the layer timed as a CUDA graph
(T tokens, attention replaced by q itself).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path

if "--device" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NO_KERNEL = {"promote_types", "empty", "empty_like", "empty_strided", "detach", "lift_fresh", "_unsafe_view", "alias"}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                 rope_theta=500000.0, vocab_size=1024, num_layers=1)


class OpCount(TorchDispatchMode):
    """Aten ops that launch a kernel, by name; Triton launches under ``triton:``."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.inside_triton = False  # the interpreter's own tensor copies are not the layer's kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and not func.is_view and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._run = InterpretedFunction.run
        ops = self.ops

        def run(fn, *args, **kwargs):
            ops["triton:" + fn.fn.__name__.strip("_")] += 1
            self.inside_triton = True
            try:
                return self._run(fn, *args, **kwargs)
            finally:
                self.inside_triton = False

        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run
        return super().__exit__(*exc)


def transformer_class(path: str | None):
    if path is None:
        from services.engine.model.layers import Transformer

        return Transformer
    spec = importlib.util.spec_from_file_location("model_under_count", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Transformer


def make(cls, cfg, weights, rope_backend, kernel_backend):
    try:
        return cls(cfg, weights, rope_backend=rope_backend, kernel_backend=kernel_backend)
    except TypeError:  # a model.py from before kernel backends
        return cls(cfg, weights, rope_backend=rope_backend)


def layer(model, h, pos, rope):
    q, k, v = model.attention_inputs(0, h, pos, rope=rope)
    return model.finish_layer(0, h, q)  # attention replaced by q (same shape)


def variants(cls, cfg, w):
    """(label, model, rope) for rotation by cos/sin tables and by positions, per kernel backend."""
    from kernels.rope import rope_cos_sin

    for kb in ("torch", "triton"):
        for rope_backend, by in (("torch", "tables"), ("triton", "positions")):
            model = make(cls, cfg, w, rope_backend, kb)
            if getattr(model, "kernels", "torch") != kb:
                continue  # a model.py from before kernel backends runs torch only

            def rope_for(pos, model=model, by=by):
                if by == "positions":
                    return None
                cos, sin = rope_cos_sin(pos, model.inv_freq)
                return cos[:, None, :], sin[:, None, :]
            yield f"kernels={kb:6s} rope by {by:9s}", model, rope_for


def count_cpu(args) -> None:
    from services.engine.model.tiny import random_weights, tiny_config
    from services.engine.model.weights import weights_from_tensors

    cls = transformer_class(args.model)
    for arch in ("llama", "qwen2", "qwen3"):
        cfg = tiny_config(arch)
        w = weights_from_tensors(random_weights(cfg, 0), cfg, torch.device("cpu"), torch.bfloat16)
        for label, model, rope_for in variants(cls, cfg, w):
            h, pos = torch.randn(5, cfg.hidden_size).bfloat16(), torch.arange(5)
            rope = rope_for(pos)
            with OpCount() as count:
                layer(model, h, pos, rope)
            print(f"{arch:6s} {label}  {sum(count.ops.values()):3d} kernels/layer  {dict(sorted(count.ops.items()))}")


def run_cuda(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from services.engine.model.config import ModelConfig
    from services.engine.model.tiny import random_weights
    from services.engine.model.weights import weights_from_tensors

    dev = torch.device("cuda")
    cfg = ModelConfig(architecture="LlamaForCausalLM", **LLAMA3_8B)
    w = weights_from_tensors({k: v.to(dev) for k, v in random_weights(cfg, 0).items()}, cfg, dev, torch.bfloat16)
    check_kernels(dev)
    cls = transformer_class(args.model)
    for t in args.tokens:
        h, pos = torch.randn(t, cfg.hidden_size, device=dev).bfloat16(), torch.arange(t, device=dev) + 3000
        for label, model, rope_for in variants(cls, cfg, w):
            rope = rope_for(pos)
            layer(model, h, pos, rope)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                layer(model, h, pos, rope)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layer(model, h, pos, rope)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                layer(model, h, pos, rope)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                graph.replay()
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / 50 * 1e3
            busy = Counter()
            for e in kernels:  # GPU time by kernel (eager, profiled): matmuls apart from the rest
                busy[e.name[:28]] += e.time_range.elapsed_us()
            print(f"T={t:5d} {label}  {len(kernels):3d} kernels/layer  {us:7.1f} us/layer (graph)  "
                  + ", ".join(f"{n} {v:.1f}" for n, v in busy.most_common()), flush=True)


def check_kernels(dev) -> None:
    """Each Triton kernel against its twin at the 8B shape, bf16 (the add is bit-equal on a GPU)."""
    from kernels import fused
    from kernels.rope import rope_cos_sin, rope_inv_freq

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    x, r = torch.randn(300, 4096, device=dev).bfloat16(), torch.randn(300, 4096, device=dev).bfloat16()
    w = (1 + 0.2 * torch.randn(4096, device=dev)).bfloat16()
    (y1, h1), (y0, h0) = (fused.add_rms_norm(x, r, w, 1e-5, backend=b) for b in ("triton", "torch"))
    print(f"add_rms_norm: residual bit-equal {torch.equal(h1, h0)}, norm rel err {rel(y1, y0):.2e}")
    gu = torch.randn(300, 2 * 14336, device=dev).bfloat16()
    print(f"silu_mul: rel err {rel(fused.silu_mul(gu, backend='triton'), fused.silu_mul(gu)):.2e}")
    qkv = torch.randn(300, 48 * 128, device=dev).bfloat16()
    inv = rope_inv_freq(128, 500000.0).to(dev)
    pos = torch.randint(0, 130000, (300,), device=dev)
    cos, sin = rope_cos_sin(pos, inv)
    norms = dict(q_norm=w[:128], k_norm=w[128:256])
    for name, rope in (("tables", dict(cos=cos[:, None], sin=sin[:, None])), ("positions", dict(positions=pos, inv_freq=inv))):
        got = fused.qkv_heads(qkv, 32, 8, backend="triton", **rope, **norms)
        want = fused.qkv_heads(qkv, 32, 8, **rope, **norms)
        print(f"qkv_heads by {name} (positions < 130000): rel err q {rel(got[0], want[0]):.2e} "
              f"k {rel(got[1], want[1]):.2e}, v equal {torch.equal(got[2], want[2])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", help="a model.py to count instead of services/engine/model/layers.py")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 528], help="CUDA: tokens of the timed layer")
    args = ap.parse_args()
    with torch.no_grad():  # not inference_mode: under it a dispatch mode does not see dtype casts
        run_cuda(args) if args.device == "cuda" else count_cpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
