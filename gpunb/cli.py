"""The `gpunb` command: `gpunb demo` trains a real model and prints what happened."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpunb", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a CNN on scikit-learn's digits and print the result")
    demo.add_argument("--epochs", type=int, default=5)
    demo.add_argument("--batch-size", default="32", help="an integer (default 32) or 'auto'")
    demo.add_argument("--precision", default="auto")
    commands.add_parser("status", help="the GPUs (or the host's CPU and RAM) right now")
    args = parser.parse_args(argv)

    from gpunb.errors import GpunbError

    try:
        if args.command == "demo":
            from gpunb.demo import run_demo

            from gpunb.render import summary_rows

            result = run_demo(args.epochs, args.batch_size, args.precision)
            print(result)
            print("\n".join(f"  {name}: {value}" for name, value in summary_rows(result)))
        else:
            from gpunb.telemetry.text import status_text

            print(status_text())
    except GpunbError as error:
        print(f"gpunb: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
