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
    cache = commands.add_parser("cache", help="gpunb's compile cache in GPUNB_HOME")
    cache.add_argument("action", choices=["clear", "show"], help="clear: delete it; show: where and how large")
    args = parser.parse_args(argv)

    from gpunb.errors import GpunbError

    try:
        if args.command == "demo":
            from gpunb.demo import run_demo

            from gpunb.render import summary_rows

            result = run_demo(**config_values(args))
            print(result)
            print("\n".join(f"  {name}: {value}" for name, value in summary_rows(result)))
        elif args.command == "cache":
            print(_cache(args.action))
        else:
            from gpunb.telemetry.text import status_text

            print(status_text())
    except GpunbError as error:
        print(f"gpunb: {as_flag_hints(str(error))}", file=sys.stderr)
        return 2
    return 0


def _cache(action: str) -> str:
    from gpunb.runtime.step import compile_cache

    folder = compile_cache.directory()
    if action == "clear":
        files, size = compile_cache.clear()
        return f"deleted {files} files ({size / 2**20:.1f} MiB) from {folder}"
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    size = sum(p.stat().st_size for p in files)
    return f"{folder}: {len(files)} files, {size / 2**20:.1f} MiB (cap {compile_cache.cap_bytes() / 2**20:.0f} MiB)"


if __name__ == "__main__":
    sys.exit(main())
