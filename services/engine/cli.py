"""``tessera model ...``: write the tiny preset, describe a model directory."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("model", help="model directories: write the tiny preset, show a model")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = msub.add_parser("init-tiny", help="write a small random model as a Hugging Face directory")
    init.add_argument("dir", help="output directory")
    init.add_argument("--arch", default="llama", help="llama | llama3 (Llama-3.1 rope scaling) | mistral | qwen2 | qwen3")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--layers", type=int, default=None, help="number of decoder layers (default 4)")
    init.set_defaults(handler=_init_tiny)
    info = msub.add_parser("info", help="print a model directory's configuration and KV footprint")
    info.add_argument("dir")
    info.set_defaults(handler=_info)


def _init_tiny(args) -> int:
    from services.engine.model.tiny import write_tiny

    overrides = {} if args.layers is None else {"num_layers": args.layers}
    path = write_tiny(args.dir, arch=args.arch, seed=args.seed, **overrides)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {path}")
    return 0


def _info(args) -> int:
    from services.engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(args.dir)
    print(f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads} (q/kv), head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, rope {cfg.rope_type} "
          f"theta {cfg.rope_theta:g}, max positions {cfg.max_position_embeddings}")
    print(f"KV per token (16-bit): {cfg.kv_bytes_per_token} B; per 512-token chunk: {cfg.kv_bytes_per_token * 512 / 2**20:.1f} MiB")
    return 0
