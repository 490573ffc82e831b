"""The ``cwm`` command line: one sub-command group per package.

Each group lives beside the code it drives (``cwm_plugin/<package>/cli.py``) and exposes
``register(subparsers)``; this module only wires them together and turns :class:`CWMError` into
one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from cwm_plugin.errors import CWMError

# (module, group name): a group whose module is missing its optional dependencies is skipped.
COMMAND_GROUPS = [
    "cwm_plugin.store.cli",
    "cwm_plugin.memory.cli",
    "cwm_plugin.sidecar.cli",
    "cwm_plugin.windows.cli",
    "cwm_plugin.mcp.cli",
    "cwm_plugin.activity.cli",
    "cwm_plugin.testing.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cwm", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="group", required=True)
    for name in COMMAND_GROUPS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that package has no commands yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # a line per HTTP call would bury each command's own output
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except CWMError as exc:
        print(f"cwm: error [{exc.code}]: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
