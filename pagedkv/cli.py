"""The ``pagedkv`` command: ``pagedkv demo [PROMPT] [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "demo":
        print("usage: pagedkv demo [PROMPT] [--page-size N] [--kv-bits B] [--max-tokens N] "
              "[--temperature T]\n\n  demo   SmolLM2-135M answering a chat prompt on a paged KV cache")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from pagedkv.demo import build_parser, run

    return run(build_parser().parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
