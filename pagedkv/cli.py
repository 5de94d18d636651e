"""The ``pagedkv`` command (``pagedkv demo [PROMPT] [options]``, ``pagedkv serve [options]``) and the argument types
the demo and the examples share, so a bad value is an argparse error, not a traceback."""

from __future__ import annotations

import argparse
import sys

from pagedkv.errors import PagedKvError


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)


def non_negative_float(text: str) -> float:
    """An argparse type: a float >= 0 (a temperature: 0 is greedy)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


USAGE = """usage: pagedkv demo [PROMPT] [--page-size N] [--kv-bits B] [--max-tokens N]
                    [--temperature T] [--seed N] [--pool-tokens N]
       pagedkv serve [--model smollm2|tiny-random|PATH.gguf] [--host H] [--port P]
                     [--pool-bytes N] [--page-size N] [--kv-bits B] [--max-batch N]

  demo   SmolLM2-135M answering a chat prompt on a paged KV cache (pagedkv demo --help)
  serve  an OpenAI-compatible server with continuous batching (pagedkv serve --help)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in ("demo", "serve"):
        if argv:
            print(f"pagedkv: unknown command {argv[0]!r}", file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "serve":
        from pagedkv.serving.server import build_parser, run
    else:
        from pagedkv.demo import build_parser, run

    parser = build_parser()
    args = parser.parse_args(argv[1:])
    try:
        return run(args)
    except PagedKvError as e:  # settings that cannot work (a pool too small for two pages, say)
        parser.error(str(e))  # (exits 2 with the usage, as a bad argument does)


if __name__ == "__main__":
    sys.exit(main())
