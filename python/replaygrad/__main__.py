"""``python -m replaygrad [--compiler NAME] script.py [args ...]``: runs an unmodified training
script with every backward on its main thread routed through replaygrad."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from ._autoload import parse_compiler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m replaygrad",
        description="Run a Python script with replaygrad.enable() around it.",
    )
    parser.add_argument(
        "--compiler",
        default="inductor",
        help="torch.compile backend name, or 'none' for the uncompiled replay (default: inductor)",
    )
    parser.add_argument("script", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    from . import enable

    sys.argv = [ns.script, *ns.args]
    # As `python script.py` does: the script's folder comes first on the import path.
    sys.path[0] = os.path.dirname(os.path.abspath(ns.script))
    with enable(parse_compiler(ns.compiler)):
        runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main()
