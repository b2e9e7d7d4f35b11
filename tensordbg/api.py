"""``tensordbg.attach()``: the composition root. It builds the session (the engine), then the
live source that serves it, then the server that carries the source to the UI; the engine
never imports the transport or the UI.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch

from tensordbg.distributed.identity import RankIdentity
from tensordbg.distributed.models import unwrap, watch_local_shards
from tensordbg.engine.capture import Capture
from tensordbg.engine.marks import recompile
from tensordbg.engine.session import (
    DEFAULT_RETAIN,
    DEFAULT_UPDATE_BUDGET,
    Session,
    attached_to,
)
from tensordbg.hit import Hit, WatchpointHit
from tensordbg.rules import RankDivergence, Rule, default_rules
from tensordbg.tracebacks import install_excepthook


class CommandLine:
    """What ``tensordbg run`` was told on its command line, while it runs a script. A script
    that attaches tensordbg itself gets those settings too (the person chose them for this run:
    ``--dump-dir`` must write a dump whoever attaches), and the run learns of the sessions the
    script made (their hits decide its exit code and its summary)."""

    KEYS = ("rules", "on_hit", "sync", "include", "exclude", "interval", "remote", "dump_dir",
            "dump_every", "dump_tensors", "dump_max_bytes")  # fmt: skip

    def __init__(self) -> None:
        self.active = False
        """Whether ``tensordbg run`` is running a script now."""
        self.settings: dict[str, Any] = {}
        self.flags = ""
        self.sessions: list[Session] = []

    def over(self, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` (a script's own attach arguments) with the command line's settings over
        them, said once."""
        if self.flags:
            print(f"tensordbg run: the script attaches tensordbg itself; the command line's "
                  f"settings ({self.flags}) apply to it", file=sys.stderr, flush=True)  # fmt: skip
            self.flags = ""
        return {**given, **self.settings}


COMMAND_LINE = CommandLine()


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    rules: Iterable[Rule] | None = None,
    on_hit: str | Callable[[Hit], None] = "pause",
    scaler: Any = None,
    *,
    include: str | Sequence[str] = (),
    exclude: str | Sequence[str] = (),
    sync: str = "auto",
    interval: int = 1,
    retain_bytes: int = DEFAULT_RETAIN,
    update_budget: int = DEFAULT_UPDATE_BUDGET,
    max_skipped_steps: int = 5,
    server: bool = True,
    remote: bool | str = False,
    ui_timeout: float | None = 30.0,
    run_id: str | None = None,
    rank: int | None = None,
    replaceable: bool = False,
    summary_at_exit: bool = True,
    dump_dir: str | os.PathLike[str] | None = None,
    dump_every: int | None = None,
    dump_tensors: str | Sequence[str] = (),
    dump_max_bytes: int | None = None,
) -> Session:
    """Watch a model's training with watchpoint rules.

    >>> session = tensordbg.attach(model, optimizer=opt)           # pause on a hit, UI-ready
    >>> session = tensordbg.attach(model, on_hit="raise")           # WatchpointHit instead
    >>> session = tensordbg.attach(model, rules=[tensordbg.rules.NaN()], on_hit="record")

    Args:
        model: the root module; every submodule is watched unless ``include``/``exclude``
            (glob patterns on module paths, e.g. ``"layers.*.attn"``) narrow it.
        optimizer: an optimizer (or several) whose steps are watched; a step ends once each
            has stepped (stepping apart, with the first's); without one, a step is a root
            forward call.
        rules: watchpoint rules; None means ``tensordbg.rules.DEFAULT``.
        on_hit: ``"pause"`` blocks the training until resumed from the UI (``tensordbg tui``) or
            ``session.controller``; ``"raise"`` raises :class:`WatchpointHit`; ``"record"`` only
            appends to ``session.hits``; ``"dump"`` records it and writes its step into
            ``dump_dir``; ``"skip"`` skips the update of a step that hit before
            its optimizer step (see ``Session.skip_step``), and raises :class:`WatchpointHit`
            after ``max_skipped_steps`` skipped updates in a row; a callable is called with
            each hit.
        scaler: a ``torch.amp.GradScaler``: gradient statistics are unscaled, and a step it skips
            for non-finite gradients is recorded in ``session.skipped_steps``, not as a hit,
            unless ``max_skipped_steps`` are skipped in a row.
        include: glob patterns of the module paths to watch (default: every module).
        exclude: glob patterns of the module paths not to watch.
        sync: ``"auto"`` (deferred on CPU, batched on CUDA), ``"eager"`` (screens every tensor
            where it is made, pauses in the hook), ``"batched"`` or ``"deferred"`` (screens the
            outputs, loss, gradients and parameters; the rest only when those show a problem);
            see :mod:`tensordbg.engine.modes`.
        interval: statistics beyond the NaN/Inf screen (norms, means, updates) every N steps.
        retain_bytes: memory for keeping the current phase's tensors for inspection (batched
            and deferred modes; eager mode keeps hits' tensors and the last few it saw, and
            holds the others weakly); a hit's own tensor is kept regardless when it is judged
            in its hook.
        update_budget: memory for copies of parameters taken to measure updates exactly.
        max_skipped_steps: how many updates in a row ``on_hit="skip"`` (or a GradScaler) may
            skip before the hit is raised instead (the training cannot recover that way).
        server: serve the session to the terminal UI over a local, authenticated socket.
        remote: listen on TCP with CURVE encryption instead of a local socket: ``True`` on
            127.0.0.1 (reach it through an SSH tunnel), or ``"HOST[:PORT]"`` to listen there,
            e.g. ``"0.0.0.0:5555"`` (every client still needs the key in the connection file).
        ui_timeout: seconds a paused training waits after the UI went away before it resumes
            with blocking watchpoints disarmed; None waits for ever.
        dump_dir: write a dump there (see the README's "Dumps"; open it with
            ``tensordbg.load``): every step with a hit, statistics and values; with
            ``on_hit="dump"`` that is all a hit does.
        dump_every: also write every N-th step: the statistics of every watched tensor, and the
            values of those whose names match ``dump_tensors`` (glob patterns, e.g.
            ``"*.weight.grad"``).
        dump_tensors: glob patterns of the tensors whose values ``dump_every``'s steps keep
            (a hit's step keeps every value anyway).
        dump_max_bytes: bound the dump's size: the oldest steps without hits go first.
        run_id: the name the UI and the dump know this run by (default: a fresh id, or the
            job's under ``torchrun``).
        rank: this process's rank in a job of several (default: ``RANK`` from the environment,
            as ``torchrun`` sets it).
        summary_at_exit: when the program exits with the session still attached and hits
            recorded, print ``session.summary()`` on stderr (as ``tensordbg run`` does).
        replaceable: a later ``attach`` of the same model detaches this session and takes
            over instead of refusing (``tensordbg run`` attaches this way, so a script that
            attaches tensordbg itself gets its own session, with the command line's settings
            over the script's arguments for them).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"attach() takes the model, a torch.nn.Module, not {type(model).__name__}")
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer or []
    if not isinstance(opts, (list, tuple)) or not all(
        isinstance(o, torch.optim.Optimizer) for o in opts
    ):
        raise TypeError(f"optimizer= is a torch.optim.Optimizer or a list of them, not "
                        f"{type(optimizer).__name__}")  # fmt: skip
    under_run = COMMAND_LINE.active and not replaceable  # the script's own, under tensordbg run
    if under_run:
        summary_at_exit = False  # tensordbg run prints it, and counts its hits in its exit code
    by_command_line = bool(COMMAND_LINE.settings) and under_run
    if by_command_line:
        given = COMMAND_LINE.over({
            "rules": rules, "on_hit": on_hit, "sync": sync, "include": include,
            "exclude": exclude, "interval": interval, "remote": remote, "dump_dir": dump_dir,
            "dump_every": dump_every, "dump_tensors": dump_tensors,
            "dump_max_bytes": dump_max_bytes})  # fmt: skip
        (rules, on_hit, sync, include, exclude, interval, remote, dump_dir, dump_every,
         dump_tensors, dump_max_bytes) = (given[k] for k in CommandLine.KEYS)  # fmt: skip
    if on_hit == "dump" and dump_dir is None:
        raise ValueError("on_hit='dump' writes hits into a dump: give dump_dir= too")
    if dump_dir is None and (dump_every is not None or dump_tensors or dump_max_bytes):
        raise ValueError("dump_every, dump_tensors and dump_max_bytes need dump_dir= too")
    if dump_every is not None or dump_max_bytes is not None:
        from tensordbg.dump.subscriber import check_settings

        check_settings(dump_every, dump_max_bytes)  # before anything is attached
    model, _ = unwrap(model)  # DistributedDataParallel: paths as in the user's model
    identity = RankIdentity.from_environment()
    if rules is None and identity.distributed:
        rules = [*default_rules(), RankDivergence()]
    existing = attached_to(model)
    replaced = existing.run_id if existing is not None and existing.replaceable else None
    if existing is not None and existing.replaceable:
        existing.detach()
    session = Session(
        model,
        optimizer,
        rules,
        on_hit,
        scaler,
        include=include,
        exclude=exclude,
        sync=sync,
        interval=interval,
        retain_bytes=retain_bytes,
        update_budget=update_budget,
        max_skipped_steps=max_skipped_steps,
        run_id=run_id or identity.run_id,
        rank=identity.rank if rank is None else rank,
    )
    session.replaceable = replaceable
    session.summary_at_exit = summary_at_exit
    if replaced is not None:  # the run id printed for it is not this session's
        print(f"tensordbg: this attach() replaces the session tensordbg run made for the model "
              f"(run {replaced}): run {session.run_id}", file=sys.stderr, flush=True)  # fmt: skip
    notices = (_unmatched(model, session.capture), _naming_nothing(session), recompile(model))
    for unmatched in filter(None, notices):
        session.log(unmatched, "warning")
        print(f"tensordbg: {unmatched}", file=sys.stderr, flush=True)
    # An uncaught hit, or a Ctrl-C at a pause, shows the user's frames only (tracebacks.py).
    session.handles.callback(install_excepthook(), "excepthook")
    try:
        if dump_dir is not None:
            from tensordbg.dump.subscriber import DumpRecorder

            patterns = (dump_tensors,) if isinstance(dump_tensors, str) else tuple(dump_tensors)
            session.dumps = DumpRecorder(session, os.fspath(dump_dir), dump_every, patterns,
                                         dump_max_bytes)  # fmt: skip
        session.sharded = watch_local_shards(session)
        if session.sharded:
            print(f"tensordbg: {len(session.sharded)} parameters are sharded (DTensor, FSDP2): "
                  "their values are checked on this rank's local shard; their gradients and "
                  "updates are not watched", file=sys.stderr, flush=True)  # fmt: skip
        if identity.distributed:
            session.hook_parameters()  # a rank's own gradients, before the all-reduce
            _link_ranks(session, identity)
        if server:
            _start_server(session, remote, ui_timeout)
        session.check_parameters("attach")
        if under_run:
            COMMAND_LINE.sessions.append(session)
    except BaseException as e:
        # All or nothing: what attach installed goes before the error reaches the user.
        session.detach()
        if isinstance(e, WatchpointHit):
            raise WatchpointHit(
                e.hit,
                f"{e} tensordbg found this while attaching and removed everything it installed: "
                "fix the model (or attach with on_hit='record' to inspect it), then attach again.",
            ) from None
        raise
    return session


def profile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    steps: int = 5,
    *,
    record_shapes: bool = False,
    profile_memory: bool = True,
    with_stack: bool = False,
    directory: str | None = None,
    **attach_args: Any,
) -> Session:
    """A session that only profiles: no watchpoint rules, nothing pauses; the next ``steps``
    steps (after one warm-up) are profiled, and the UI's profiler tabs show the report.

    >>> session = tensordbg.profile(model, opt, steps=5)
    >>> train(model, opt)                             # a few more than 5 steps
    >>> print(session.profiling.wait(60).text())      # the ProfileHandle's report
    >>> session.detach()

    A report nobody waited for is printed on stderr at the program's exit.

    ``attach_args`` are :func:`attach`'s (``server``, ``run_id``...); see
    :meth:`Session.profile` for the rest.
    """
    attach_args.setdefault("summary_at_exit", False)
    session = attach(model, optimizer, rules=[], on_hit="record", **attach_args)
    try:
        handle = session.profile(steps, record_shapes=record_shapes, profile_memory=profile_memory,
                                 with_stack=with_stack, directory=directory)  # fmt: skip
        handle.report_at_exit = True  # a script that never waits for it still sees it
    except BaseException:
        session.detach()
        raise
    return session


def _link_ranks(session: Session, identity: RankIdentity) -> None:
    """One rank of several: pause and stop with the others through the job's store, and
    exchange the fingerprints of RankDivergence."""
    from tensordbg.distributed.coordination import RankLink, launcher_store
    from tensordbg.distributed.fingerprints import Fingerprints

    try:
        store = launcher_store()
    except Exception as e:  # no store: this rank is watched alone
        store, reason = None, str(e)
    else:
        reason = "no MASTER_ADDR/MASTER_PORT and no initialised process group"
    if store is None:
        warnings.warn(
            f"tensordbg: rank {identity.rank} of {identity.world_size} cannot reach the job's "
            f"store ({reason}): its hits are recorded but do not pause or stop the other ranks",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    link = RankLink(session, store, identity.with_run_id(session.run_id))
    session.ranks = link
    fingerprints = Fingerprints(session, link.store, identity.rank)
    session.handles.callback(
        session.bus.subscribe(fingerprints.on_step_end, events={"step_end"}), "fingerprints"
    )


def _start_server(session: Session, remote: bool | str, ui_timeout: float | None) -> None:
    try:
        from tensordbg.sources.live import LiveSource
        from tensordbg.transport.server import Server, listen_address

        script = sys.argv[0] if sys.argv and sys.argv[0] else "<python>"
        host, port = listen_address(remote) if isinstance(remote, str) else ("127.0.0.1", 0)
        source = LiveSource(session, ui_timeout=ui_timeout)
        server = Server(
            source,
            run_id=session.run_id,
            rank=session.rank,
            script=script,
            remote=bool(remote),
            host=host,
            port=port,
            on_clients=source.on_clients,
        )
        # Stopped by the session's detach, at exit too: after its last words ("finished"), which
        # the server's own exit handler, run first, would have cut off.
        info = server.start(stop_at_exit=False)
        session.server = server
        session.handles.callback(server.stop, "the UI server")
        if remote:  # a UI elsewhere needs to be told where, and with which file
            print(f"tensordbg: listening on {info.endpoint} (CURVE-encrypted); a UI connects "
                  f"with this connection file, which holds its key: tensordbg tui {info.path}",
                  file=sys.stderr, flush=True)  # fmt: skip
    except Exception as e:  # the debugger must never stop a training over its UI
        # With no UI to resume it, a pause would block for ever: hits are recorded instead.
        paused = session.on_hit == "pause"
        if paused:
            session.on_hit = "record"
        warnings.warn(
            f"tensordbg: the UI server did not start ({e}); hits are "
            + ("recorded instead of pausing the training" if paused else "still recorded")
            + ". To get a UI next time, fix that cause (see TENSORDBG_RUNTIME_DIR in the README) "
            "or attach with server=False and drive the session from code.",
            RuntimeWarning,
            stacklevel=3,
        )


def _unmatched(model: torch.nn.Module, capture: Capture) -> str | None:
    """What to say when ``include``/``exclude`` leave only the root watched, though it has
    modules."""
    include, exclude = capture.include, capture.exclude
    names = [path for path, _ in model.named_modules() if path]
    if not (include or exclude) or not names or len(capture.paths) > 1:
        return None
    given = " with ".join(f"{what}={list(patterns)}" for what, patterns in
                          (("include", include), ("exclude", exclude)) if patterns)  # fmt: skip
    return (
        f"{given} leaves no module of {type(model).__name__} watched: only its own inputs "
        f"and outputs, the gradients and the parameters are; its modules are named "
        f"{', '.join(repr(n) for n in names[:4])}{', ...' * (len(names) > 4)}"
    )


def _naming_nothing(session: Session) -> str | None:
    """What to say of rules whose ``match`` names, as a module path would, no module, tensor
    or parameter of the model (a typo, a module it lacks): they would judge nothing, and say
    nothing. A pattern without a dot may name an observed tensor (``loss``): not judged here."""
    paths = [p for p in session.capture.paths.values() if p]
    kinds = ("output", "input[0]", "grad_output", "grad_input[0]")
    names = {*paths, *kinds, *(f"{path}.{kind}" for path in paths for kind in kinds)}
    for name in session.params_by_name:
        names.update((name, f"{name}.grad", f"{name}.update"))
    silent = []
    for active in session.rules:
        patterns = [p for p in active.rule.match if "." in p]
        if patterns and not any(fnmatchcase(n, p) for p in patterns for n in names):
            silent.append(f"{active.rule.name}(match={list(active.rule.match)})")
    if not silent:
        return None
    shown = [f"{paths[-1]}.output" if paths else "output",
             *(f"{name}.grad" for name in list(session.params_by_name)[-1:])]  # fmt: skip
    example = ", ".join(map(repr, shown))
    return (f"{' and '.join(silent)} names no module, tensor or parameter of "
            f"{type(session.model).__name__} (its names look like {example}): it will judge "
            "nothing unless an output's field (.logits) is named so at run time")  # fmt: skip


__all__ = ["attach", "attached_to", "profile"]
