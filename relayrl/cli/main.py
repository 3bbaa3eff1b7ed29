"""``relayrl train | eval | plot | demo | serve | dock | plan``: :func:`main` parses the command line
(:mod:`relayrl.cli.parser`) and runs the command's handler (:mod:`relayrl.cli.commands`,
:mod:`relayrl.cli.eval_command`) inside the CLI's error boundary. The parser and the handlers are re-exported."""

from __future__ import annotations

import sys

from relayrl.cli.commands import (DEMO_MARK, RECIPES, cmd_demo, cmd_dock, cmd_plot, cmd_serve, cmd_train,
                                  resolved_config)  # re-exported
from relayrl.cli.eval_command import cmd_eval  # re-exported
from relayrl.cli.parser import build_parser, builtin_tasks, parse_args  # (build_parser, builtin_tasks re-exported)

__all__ = ["main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the command inside the CLI's error boundary (``relayrl.cli.boundary``)."""
    args = parse_args(argv)
    from relayrl.cli.boundary import debug_requested, run_guarded

    return run_guarded(args.fn, args, debug=debug_requested(getattr(args, "debug", False)))


if __name__ == "__main__":
    sys.exit(main())
