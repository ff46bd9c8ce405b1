"""The `hf-mars` command: one sub-command per job, each defined next to the code it runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# sub-command -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int | None`.
COMMANDS = {
    "demo": ("hf_mars.demo.pipeline", "Train, decode and report MARS on the embedded tiny default (offline, CPU)."),
    "bench": ("hf_mars.bench.command", "Tokens/s and tokens/forward of MARS decoding against plain generate."),
    "push": ("hf_mars.hub", "Push a MARS checkpoint folder to the Hugging Face Hub."),
    "serve": ("hf_mars.serve", "OpenAI-compatible server: batched MARS decoding with a load-adaptive τ ladder."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mars", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv=None) -> int:
    """Run a sub-command. A user error (bad path, bad value, unwritable folder) is one line on stderr,
    ``hf-mars <cmd>: error: ...``, and exit status 2; set HF_MARS_DEBUG=1 for the traceback."""
    args = build_parser().parse_args(argv)
    try:
        rc = importlib.import_module(args._module).run(args)
    except (ValueError, OSError) as e:
        if os.environ.get("HF_MARS_DEBUG"):
            raise
        print(f"hf-mars {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
