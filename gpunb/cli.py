"""The `gpunb` command: `gpunb demo` trains a real model and prints what happened."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from gpunb.config_flags import add_config_flags, as_flag_hints, config_values

    parser = argparse.ArgumentParser(prog="gpunb", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a CNN on scikit-learn's digits and print the result",
                               description="Train a CNN on scikit-learn's digits (5 epochs, batch 32, the "
                                           "one-cycle schedule unless told otherwise); every TrainConfig "
                                           "option below is taken.", allow_abbrev=False)
    add_config_flags(demo)
    commands.add_parser("status", help="the GPUs (or the host's CPU and RAM) right now")
    args = parser.parse_args(argv)

    from gpunb.errors import GpunbError

    try:
        if args.command == "demo":
            from gpunb.demo import run_demo

            from gpunb.render import summary_rows

            result = run_demo(**config_values(args))
            print(result)
            print("\n".join(f"  {name}: {value}" for name, value in summary_rows(result)))
        else:
            from gpunb.telemetry.text import status_text

            print(status_text())
    except GpunbError as error:
        print(f"gpunb: {as_flag_hints(str(error))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
