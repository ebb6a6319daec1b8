"""The `flywheel` command line's `ArgumentParser`: every parser, subcommands' included, refuses
what it cannot parse with its own usage."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class CliParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose subcommands refuse arguments they do not know with their own
    usage (`flywheel up --bogus` shows `usage: flywheel up ...`), not the top-level one that
    argparse shows for whatever a subcommand leaves over; and a command given without its
    subcommand (`flywheel config`) shows its help with the subcommands to choose from, not
    argparse's `the following arguments are required: config_command`."""

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse `args`; the innermost parser that is left arguments it does not know exits.

        Raises:
            SystemExit: exit status 2, this parser's usage and `unrecognized arguments: ...`.
        """
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        """Exit 2 with this parser's usage and `message`; with its whole help (the subcommands
        and what each does) when the missing argument is its subcommand."""
        missing = message.removeprefix("the following arguments are required: ").split(", ")
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest in missing:
                self.print_help(sys.stderr)
                names = ", ".join(action.choices)
                kind = "subcommand" if " " in self.prog else "command"
                self.exit(2, f"{self.prog}: error: name a {kind}: {names}\n")
        super().error(message)
