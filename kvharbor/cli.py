"""``kvharbor`` command line: offline generation, tenant administration, dashboards."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands through ``add_commands(subparsers)``.
COMMAND_MODULES = ["kvharbor.tenants.cli", "kvharbor.observability.cli"]


def _generate(args: argparse.Namespace) -> int:
    from kvharbor import LLM, SamplingParams  # noqa: PLC0415 - keep `kvharbor --help` fast

    llm = LLM(model=args.model, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvharbor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default="kvharbor/tiny-llama",
                     help="builtin id, local checkpoint directory or hub id")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=_generate)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
