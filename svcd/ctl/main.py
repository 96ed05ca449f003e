"""
svcctl's command line read and one command run (L{svcd.ctl}): the parser
of every command group, in the order C{svcctl --help} lists them, and
L{main}, the console script, which prints the command's document or its
one line of error with the exit status of L{svcd.ctl}'s docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from svcd.auth.store import Store
from svcd.auth.usage import BadUsage
from svcd.common.migrations import migrate
from svcd.common.pgtransactions import StoreRejected, StoreUnavailable, StoreValueRefused
from svcd.ctl import budgets, limits, memory, organizations, tokens, usage
from svcd.ctl.commandline import CommandError, Parser


def buildParser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="svcctl",
        description="Operate the svc gateway's database: migrations, organizations, "
        "agents, tokens, limits, budgets, usage, memories and memory settings. Prints one "
        "JSON document on stdout.",
    )
    parser.add_argument(
        "--dsn",
        help="PostgreSQL connection string of the schema owner (default: $POSTGRES_DSN)",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    commands.add_parser("migrate", help="apply pending migrations (safe to repeat)")
    organizations.addCommands(commands)
    tokens.addCommands(commands)
    limits.addCommands(commands)
    budgets.addCommands(commands)
    usage.addCommands(commands)
    memory.addCommands(commands)
    return parser


def run(arguments: argparse.Namespace, dsn: str) -> dict[str, Any] | str:
    """
    Carry out one parsed command and return the JSON document to print (or
    the text, for svcctl usage --format csv).
    """
    if arguments.command == "migrate":
        return {"applied": migrate(dsn)}

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as connection:
        store = Store(lambda: contextlib.nullcontext(connection))

        if arguments.command in ("org", "agent"):
            return organizations.run(store, arguments)

        if arguments.command == "token":
            return tokens.run(store, arguments)

        if arguments.command == "limits":
            return limits.run(store, arguments)

        if arguments.command == "budget":
            return budgets.run(store, arguments)

        if arguments.command == "usage":
            return usage.run(store, arguments)

        if arguments.command == "memory":
            return memory.run(store, connection, arguments)

    command = (arguments.command, getattr(arguments, "action", None))
    raise CommandError(f"unknown command {command}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = buildParser()
    arguments = parser.parse_args(argv)
    dsn = arguments.dsn or os.environ.get("POSTGRES_DSN", "").strip()
    if not dsn:
        sys.stderr.write("svcctl: error: POSTGRES_DSN is not set and --dsn was not given\n")
        return 2
    try:
        document = run(arguments, dsn)
    except BadUsage as error:
        # A command line the parser could not check alone (since after
        # until): the operator's mistake, as argparse's are.
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 2
    except CommandError as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    except (StoreUnavailable, StoreRejected, StoreValueRefused) as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    except psycopg.Error as error:
        # The first line of PostgreSQL's message (no DSN, no password).
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        sys.stderr.write(f"svcctl: error: database: {type(error).__name__}: {message}\n")
        return 1
    except OSError as error:
        sys.stderr.write(f"svcctl: error: {error}\n")
        return 1
    if isinstance(document, str):
        sys.stdout.write(document)
    else:
        sys.stdout.write(json.dumps(document) + "\n")
    return 0
