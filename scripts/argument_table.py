"""Write docs/arguments.md: the status of every argument of `pretrain_gpt_recover.py`.

Usage: .venv/bin/python scripts/argument_table.py [--check]

The table comes from `megatron_recover/megatron/config/argument_table.py` and the parser, so the docs
cannot drift from the code: `--check` exits 1 when docs/arguments.md is not what this script
writes (tests/test_argument_table.py runs the same comparison).
"""

import argparse
import sys
from pathlib import Path

from megatron_recover.megatron.config import argument_table
from megatron_recover.megatron.config.arguments import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs" / "arguments.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/arguments.md instead of writing it")
    args = parser.parse_args()
    text = argument_table.markdown(build_parser())
    if args.check:
        if not DOCS.is_file() or DOCS.read_text() != text:
            print(f"{DOCS} is out of date: run .venv/bin/python scripts/argument_table.py",
                  file=sys.stderr)
            return 1
        print(f"{DOCS} is current")
        return 0
    DOCS.write_text(text)
    counts = {}
    for entry in argument_table.table(build_parser()).values():
        counts[entry.status] = counts.get(entry.status, 0) + 1
    print(f"wrote {DOCS}: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
