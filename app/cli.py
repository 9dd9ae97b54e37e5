"""Command line: ``python -m app.cli generate "prompt"`` (console script: ``tandem``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving on Ray Serve")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default="default", help="'default', a HF model directory or a .gguf file")
    gen.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 or float16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return parser


def generate(args: argparse.Namespace) -> int:
    from engine.params import SamplingParams

    try:  # a bad argument is refused before torch and the model load (seconds)
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.loader import ModelSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        core = EngineCore.from_spec(
            ModelSpec(source=args.model, dtype=args.dtype, device=args.device),
            EngineConfig(max_model_len=4096, kv_cache_bytes=256 << 20),
        )
        prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
        core.add_request(core.make_request(prompt, sampling))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    while core.has_work():
        for out in core.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
    sys.stdout.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "generate":
        return generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
