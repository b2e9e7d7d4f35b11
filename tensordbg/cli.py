"""The ``tensordbg`` command: ``demo``, ``run``, ``tui``, and over dumps ``replay``, ``check``,
``diff``. It imports neither torch nor the UI until a command needs them: ``--help`` is quick."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from tensordbg import __version__
from tensordbg.rules import available_rules

EXAMPLES = {
    "tensordbg": """
        examples:
          tensordbg demo                 a tiny GPT trains until a batch breaks it
          tensordbg run train.py --epochs 3
          tensordbg tui                  open the UI on a running training

        Run `tensordbg COMMAND --help` for a command's options and more examples.
        """,
    "demo": """
        examples:
          tensordbg demo          a tiny GPT trains until a batch breaks it, in the UI
          tensordbg demo --no-ui  the same training, hits printed as text
        """,
    "run": """
        examples:
          tensordbg run train.py --epochs 3
          tensordbg run --rules default,DeadActivation --on-hit record train.py
          tensordbg run --include 'encoder.*' --sync batched train.py
          tensordbg run --profile 5 train.py   profile 5 steps; a summary and advice

        The script runs as __main__ with its own arguments; the first module with
        trainable parameters it calls is watched, with the optimizers made for it (and
        one made later, from its first step). A Hugging Face or Lightning Trainer gets
        tensordbg's callback instead. Open the UI with `tensordbg tui` in another
        terminal.

        exit code: the script's own, except 1 when it exits 0 after a watchpoint
        hit (as a linter: a CI job fails when something hit); 2 for a mistake in the
        rules given; 130 after Ctrl-C.
        """,
    "tui": """
        examples:
          tensordbg tui                              the only session, or a list
          tensordbg tui /run/user/1000/tensordbg/3f2a1c9e-0.json
          tensordbg tui --run-id 3f2a1c9e --wait 30  wait for a training starting now
        """,
    "replay": """
        examples:
          tensordbg replay runs/dbg     the UI over a dump; n / p: next / previous step
          tensordbg replay runs/dbg --rank 1 --step 120
        """,
    "check": """
        examples:
          tensordbg check runs/dbg                     the run's own rules, a table
          tensordbg check runs/dbg --rules default,DeadActivation --json
          tensordbg check runs/dbg --rule "TensorRange(match='*.attn.*', max_gt=1e4)"

        Exit status: 0 clean, 1 a rule hits (or, with --strict, could not judge a
        tensor), 2 the dump, a step or a values file cannot be read, the dump is
        incomplete, or a rule had nothing in the dump it could judge (and no rule hit).
        """,
    "diff": """
        examples:
          tensordbg diff runs/eager runs/compiled
          tensordbg diff runs/a runs/b --rtol 1e-3 --atol 1e-6 --json
          tensordbg diff runs/ddp runs/ddp --ranks 0,1     rank 0 against rank 1

        Exit status: 0 the runs agree, 1 they differ, 2 a dump cannot be read, or part
        of one cannot and the runs agree on what could be read.
        """,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser: its usage, not the top level's
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        command = commands.choices.get(getattr(args, "command", None) or "", parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):  # a usage error, as argparse's own: status 2
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:  # before a script ran, or its own handling (importing torch)
        print(f"tensordbg {args.command}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `| head` stopped reading: quietly, as other tools (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensordbg",
        description="An interactive numerical debugger for PyTorch training.",
        epilog=textwrap.dedent(EXAMPLES["tensordbg"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tensordbg {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = _command(commands, "demo", "train a small model that goes wrong, with the UI attached")
    demo.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    demo.add_argument(
        "--bad-step", type=int, default=25, help="the step whose batch is broken (default 25)"
    )
    demo.add_argument(
        "--no-ui", action="store_true", help="print a summary of the hits instead of the UI"
    )
    demo.set_defaults(handler=_demo)

    run = _command(commands, "run", "debug a training script without changing it")
    run.add_argument(
        "--rules",
        default=None,
        help="comma-separated rule names; 'default' is the default set; the rules: "
        + ", ".join(sorted(available_rules())),
    )
    run.add_argument(
        "--on-hit",
        choices=("pause", "raise", "record", "dump", "skip"),
        default=None,
        help="what a hit does: pause the training for the UI (the default), raise "
        "WatchpointHit, only record it, record it and write its step into --dump-dir (the "
        "default with --dump-dir: a job that writes a dump goes on without a person), or skip "
        "the update of the step that hit (its gradients dropped, as GradScaler skips a step; "
        "after 5 skipped updates in a row it raises WatchpointHit)",
    )
    run.add_argument(
        "--sync",
        choices=("auto", "eager", "batched", "deferred"),
        default=None,
        help="when statistics reach the host: eager (at each tensor), batched (once a phase), "
        "deferred (the cheapest: the rest only when outputs, loss or gradients show a problem), "
        "auto (default: deferred on the CPU, batched on CUDA)",
    )
    run.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATTERN",
        help="watch only modules whose path matches (repeatable)",
    )
    run.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="do not watch modules whose path matches (repeatable)",
    )
    run.add_argument(
        "--interval",
        type=_interval,
        default=None,
        help="statistics beyond the NaN/Inf screen every N steps (N >= 1)",
    )
    run.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="SPEC",
        help="a rule with its arguments, in place of --rules' rule of its class (repeatable), e.g. "
        "\"TensorRange(match='*.attn.*', max_gt=1e4)\"; read as data, never run as code",
    )
    run.add_argument(
        "--remote",
        action="store_true",
        help="listen on TCP with CURVE encryption instead of a local socket, on 127.0.0.1 (for "
        "an SSH tunnel) unless --listen says where; a UI needs the connection file (its keys)",
    )
    run.add_argument(
        "--listen",
        metavar="HOST[:PORT]",
        type=_listen,
        help="with --remote: where to listen, e.g. 0.0.0.0:5555 (implies --remote)",
    )
    run.add_argument(
        "--dump-dir",
        metavar="DIR",
        help="write a dump there: every step with a hit (open it with tensordbg replay, or "
        "tensordbg.load in Python)",
    )
    run.add_argument(
        "--dump-every",
        type=_interval,
        metavar="N",
        help="with --dump-dir: also write every N-th step (statistics of every watched tensor)",
    )
    run.add_argument(
        "--dump-tensors",
        action="append",
        default=[],
        metavar="PATTERN",
        help="with --dump-every: the values of the tensors whose names match, e.g. "
        "'*.weight.grad' (repeatable)",
    )
    run.add_argument(
        "--dump-max-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="with --dump-dir: bound the dump's size (500M, 2G): the oldest steps without hits "
        "go first, then, oldest first, those with hits but the first and the newest",
    )
    run.add_argument(
        "--profile",
        type=_profile_steps,
        default=0,
        metavar="N",
        help="profile N training steps (after the first step and one warm-up step) with "
        "torch.profiler; the summary, the advice and where the trace is are printed at the end",
    )
    run.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                     help="run a module as python -m does, its arguments after it")  # fmt: skip
    run.add_argument("script", nargs="?", help="the training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.set_defaults(handler=_run)

    tui = _command(commands, "tui", "open the terminal UI on a running training")
    tui.add_argument("connection", nargs="?", help="a session's connection file")
    tui.add_argument("--run-id", help="the run to open (waits for it with --wait)")
    wait = "seconds to wait for a training to start (the one of --run-id, else any)"
    tui.add_argument("--wait", type=float, default=0.0, help=wait)
    tui.set_defaults(handler=_tui)

    replay = _command(commands, "replay", "open the terminal UI on a dump of a recorded run")
    replay.add_argument("dump", help="the dump's directory (attach(dump_dir=...))")
    replay.add_argument("--rank", type=int, default=None, help="the rank to show (default: first)")
    replay.add_argument("--step", type=int, default=None, help="the dumped step to open at")
    replay.set_defaults(handler=_offline("replay"))

    check = _command(commands, "check", "judge a dump with rules again, offline")
    check.add_argument("dump", help="the dump's directory")
    check.add_argument(
        "--rules",
        default=None,
        help="comma-separated rule names ('default' is the default set); without it and "
        "--rule, the rules the run was recorded with",
    )
    check.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="SPEC",
        help="a rule with its arguments, as for tensordbg run (repeatable)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 also when a rule could not judge a tensor (a statistic it needs was not "
        "dumped, nor the values to compute it)",
    )
    check.set_defaults(handler=_offline("check"))

    diff = _command(commands, "diff", "find where two dumped runs parted")
    diff.add_argument("a", help="the first dump's directory")
    diff.add_argument("b", help="the second dump's directory")
    diff.add_argument("--rtol", type=_tolerance, default=1e-5, help="relative tolerance (1e-5)")
    diff.add_argument("--atol", type=_tolerance, default=1e-8, help="absolute tolerance (1e-8)")
    diff.add_argument("--ranks", type=_ranks, default=(0, 0), metavar="RA,RB",
                      help="rank RA of A against rank RB of B (0,0; R alone: both R)")  # fmt: skip
    diff.add_argument("--json", action="store_true", help="print the report as JSON")
    diff.set_defaults(handler=_offline("diff"))
    return parser


def _command(commands: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    return commands.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        epilog=textwrap.dedent(EXAMPLES[name]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _usage(message: str) -> SystemExit:
    """A mistake in the command line: said on stderr, exit status 2 (as argparse does)."""
    print(message, file=sys.stderr)
    return SystemExit(2)


def _rules(spec: str) -> list:
    from tensordbg.rules import available_rules, default_rules
    from tensordbg.rules.catalog import unknown_rule

    names = [n.strip() for n in spec.split(",") if n.strip()]
    available = available_rules()
    rules = []
    for name in names:
        if name == "default":
            rules.extend(default_rules())
        elif name in available:
            try:
                rules.append(available[name]())
            except (TypeError, ValueError) as e:  # a rule that needs arguments
                raise _usage(f"tensordbg: {e}; give {name} its arguments with "
                             f'--rule "{name}(...)" instead of --rules') from None  # fmt: skip
        else:
            raise _usage(f"tensordbg: {unknown_rule(name)}")
    return rules


def _interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the interval is a number of steps, at least 1")
    return value


def _tolerance(text: str) -> float:
    from tensordbg.offline.diff import tolerance

    try:
        return tolerance(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a tolerance is a finite number, 0 or more"
        ) from None


def _rule(spec: str) -> Any:
    """``"TensorRange(match='*.attn.*', max_gt=1e4)"`` as a rule (read as data, never run)."""
    from tensordbg.rules.catalog import rule_from_spec

    try:
        return rule_from_spec(spec)
    except ValueError as e:
        raise _usage(f"tensordbg: --rule {spec!r}: {e}") from None


def _listen(text: str) -> str:
    from tensordbg.transport.server import listen_address

    try:
        listen_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _profile_steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if not 1 <= steps <= 1000:
        raise argparse.ArgumentTypeError(f"a number of steps from 1 to 1000, not {text!r}")
    return steps


def _size(text: str) -> int:
    """``500M``, ``2G``, ``1.5G`` or a number of bytes."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = text.strip().upper().removesuffix("B"), ""
    if number[-1:] in units:
        number, unit = number[:-1], number[-1]
    try:
        size = int(float(number) * units[unit])
    except (ValueError, OverflowError):
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size such as 500M or 2G, not {text!r}")
    return size


def _run(args: argparse.Namespace) -> int:
    from tensordbg.dump.writer import unwritable_reason
    from tensordbg.integrations.runner import run_script
    from tensordbg.rules import default_rules
    from tensordbg.rules.catalog import with_given

    if args.script is None and not args.module:
        print("tensordbg run: which script? e.g. tensordbg run train.py --epochs 3, or -m "
              "pkg.train (see tensordbg run --help)", file=sys.stderr)  # fmt: skip
        return 2
    if args.dump_dir is None and (args.dump_every or args.dump_tensors or args.on_hit == "dump"
                                  or args.dump_max_bytes):  # fmt: skip
        print("tensordbg run: --dump-every, --dump-tensors, --dump-max-bytes and --on-hit dump "
              "write into a dump: give --dump-dir DIR too", file=sys.stderr)  # fmt: skip
        return 2
    dumps = {}
    if args.dump_dir is not None and (why := unwritable_reason(args.dump_dir)):
        print(f"tensordbg run: cannot write a dump in {args.dump_dir}: {why}", file=sys.stderr)
        return 2
    if args.dump_dir is not None:
        dumps = {"dump_dir": args.dump_dir, "dump_every": args.dump_every,
                 "dump_tensors": args.dump_tensors or None,
                 "dump_max_bytes": args.dump_max_bytes}  # fmt: skip
    rules = None if args.rules is None else _rules(args.rules)
    if args.rule:
        rules = with_given(default_rules() if rules is None else rules, [*map(_rule, args.rule)])
    if rules == []:
        print("tensordbg run: no rules (--rules ''): statistics are kept, nothing can hit",
              file=sys.stderr)  # fmt: skip
    # Only the flags given (None: not given): they apply over a script's own attach() too.
    return run_script(args.script, args.args, rules=rules, on_hit=args.on_hit, sync=args.sync,
                      include=args.include or None, exclude=args.exclude or None,
                      interval=args.interval, remote=args.listen or args.remote or None, **dumps,
                      profile_steps=args.profile, module=args.module)  # fmt: skip


def _tui(args: argparse.Namespace) -> int:
    from tensordbg.tui import run_tui

    return run_tui(args.connection, run_id=args.run_id, wait=args.wait)


def _ranks(text: str) -> tuple[int, int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if len(ranks) not in (1, 2) or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give two ranks as RA,RB (or one for both)")
    return (ranks[0], ranks[-1])


def _offline(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler of ``replay``, ``check`` or ``diff`` (offline/commands.py, imported then)."""

    def handler(args: argparse.Namespace) -> int:
        from tensordbg.offline import commands

        return int(getattr(commands, name)(args, rules=_rules, rule=_rule))

    return handler


def _demo(args: argparse.Namespace) -> int:
    demo_args = ["--steps", str(args.steps), "--bad-step", str(args.bad_step)]
    if args.no_ui:
        from tensordbg import demo

        return demo.main([*demo_args, "--no-ui"])
    if not sys.stdout.isatty():
        print("tensordbg demo needs a terminal; use `tensordbg demo --no-ui` to print the hits.")
        return 2
    from tensordbg.profiler.handle import report_last
    from tensordbg.tui import run_tui

    run_id = f"demo{secrets.token_hex(3)}"
    log = tempfile.NamedTemporaryFile("w", prefix="tensordbg-demo-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "TENSORDBG_RUN_ID": run_id}
    command = [sys.executable, "-m", "tensordbg.demo", *demo_args, "--ends-with-ui"]
    training = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    stopped = False  # by us, below: not a failure of the training
    try:
        # Without alive, a training that dies before or after the UI connects is waited for
        # (and reconnected to) for ever.
        code = run_tui(run_id=run_id, wait=120.0, alive=lambda: training.poll() is None,
                       ends_training=True)  # fmt: skip
    finally:
        # The demo's training is the demo's: quitting the UI ends it at once (Ctrl-C, then
        # harder), rather than leaving the person before a silent terminal until it ends.
        if training.poll() is None:
            stopped = True
            training.send_signal(signal.SIGINT)
            try:
                training.wait(timeout=5)
            except subprocess.TimeoutExpired:
                training.terminate()
                training.wait(timeout=10)
        log.close()
    with open(log.name) as f:
        print("the training's output, its end:", *report_last(f.read()), sep="\n")
    if training.returncode and not stopped:
        print(f"The demo training failed (exit status {training.returncode}): its whole output "
              f"is in {log.name}")  # fmt: skip
    else:
        os.unlink(log.name)  # its end is above: a demo leaves nothing behind
    return code


if __name__ == "__main__":
    sys.exit(main())
