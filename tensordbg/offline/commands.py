"""The ``replay``, ``check`` and ``diff`` commands of ``tensordbg`` (see tensordbg/cli.py):
each opens its dumps, says in one sentence when one cannot be read (exit status 2), and runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any


def _open_dump(path: str, command: str, as_json: bool = False) -> Any:
    """The dump at ``path``, or None after one sentence on stderr saying why it cannot be read
    (``as_json``: and on stdout, as ``{"schema": 1, "dump": path, "error": why}``)."""
    import json

    from tensordbg.dump import DumpError, load

    try:
        return load(path)
    except DumpError as e:
        print(f"tensordbg {command}: {e}", file=sys.stderr)
        if as_json:  # a CI job that parses the report reads why, not nothing
            print(json.dumps({"schema": 1, "dump": path, "error": str(e)}))
        return None


# ``rules`` and ``rule`` read --rules and --rule as ``tensordbg run`` does (tensordbg/cli.py).
Parser = Callable[[str], Any]


def replay(args: argparse.Namespace, **_: Parser) -> int:
    from tensordbg.sources.contract import SourceError
    from tensordbg.sources.replay import ReplaySource

    dump = _open_dump(args.dump, "replay")
    if dump is None:
        return 2
    try:
        source = ReplaySource(dump, rank=args.rank)
        if args.step is not None:
            source.goto(step=args.step)
    except SourceError as e:
        print(f"tensordbg replay: {e}", file=sys.stderr)
        return 2
    if not sys.stdout.isatty():
        print("tensordbg replay needs a terminal; `tensordbg check` reads a dump as text.",
              file=sys.stderr)  # fmt: skip
        return 2
    from tensordbg.transport.client import LocalClient
    from tensordbg.tui.app import TensorDbgApp

    app = TensorDbgApp(LocalClient(source))
    result = app.run()
    report = app.crash_file.exit_message()
    if report is not None:
        print(report, file=sys.stderr)
    return app.return_code or int(result or 0)


def check(args: argparse.Namespace, *, rules: Parser, rule: Parser) -> int:
    import json

    dump = _open_dump(args.dump, "check", as_json=args.json)
    if dump is None:
        return 2
    from tensordbg.offline.check import check_dump

    chosen = None
    if args.rules is not None or args.rule:
        from tensordbg.rules.catalog import with_given

        named = rules("default" if args.rules is None else args.rules)
        chosen = with_given(named, [*map(rule, args.rule)])
        if not chosen:  # a lint with nothing to judge would pass anything (an empty variable)
            print("tensordbg check: no rules to judge with (--rules '' names none): name some, "
                  "or leave --rules out for the run's own", file=sys.stderr)  # fmt: skip
            return 2
    report = check_dump(dump, chosen)
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        print(report.table())
    if args.strict and report.unjudged:  # at least 1: never more lenient than without it
        return max(report.exit_code, 1)
    return report.exit_code


def diff(args: argparse.Namespace, **_: Parser) -> int:
    import json

    a = _open_dump(args.a, "diff")
    b = _open_dump(args.b, "diff") if a is not None else None
    if a is None or b is None:
        return 2
    from tensordbg.offline.diff import diff_dumps

    for dump, rank in ((a, args.ranks[0]), (b, args.ranks[1])):
        if rank not in dump.ranks:
            print(f"tensordbg diff: {dump.path} has no rank {rank} (ranks: {dump.ranks})",
                  file=sys.stderr)  # fmt: skip
            return 2
    report = diff_dumps(a, b, rtol=args.rtol, atol=args.atol, ranks=args.ranks)
    print(json.dumps(report.as_json(), indent=1) if args.json else report.text())
    return report.exit_code
