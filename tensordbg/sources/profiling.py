"""The profiling requests of a live training (``profile``, ``profile_report``, ``gpu``): part
of :class:`~tensordbg.sources.live.LiveSource`. The profiler runs in the training process
(:mod:`tensordbg.profiler`); only its report and NVML samples cross the wire."""

from __future__ import annotations

import contextlib
from typing import Any

from tensordbg.sources import contract
from tensordbg.sources.contract import SourceError


class LiveProfiling:
    """The profiling part of a live source (it serves ``self.session``)."""

    session: Any
    _gpu: Any = None  # the NVML sampler, made by the first gpu() request

    def profile(self, steps: int = 5, record_shapes: bool = False) -> contract.ProfilePending:
        """Profile the next ``steps`` steps: started by the training thread at its next step
        boundary (through the control plane); the ``profile`` event says when it is done."""
        from tensordbg.profiler.capture import ProfileError

        try:
            self.session.profile(steps, record_shapes=record_shapes)
        except ProfileError as e:
            raise SourceError(str(e)) from None
        return {"pending": True, "steps": steps}

    def profile_report(self) -> contract.ProfileReport | None:
        profiler = self.session.__dict__.get("_profiler")
        report = profiler.latest if profiler is not None else None
        return report.to_dict() if report is not None else None  # type: ignore[return-value]

    def gpu(self, since: float = 0.0) -> contract.Gpu:
        """NVML samples newer than ``since``; the sampler starts on the first request (nothing
        is sampled while no UI looks) and stops at detach."""
        if self._gpu is None:
            from tensordbg.profiler.nvml import GpuSampler

            self._gpu = GpuSampler()
            if self._gpu.start():
                with contextlib.suppress(RuntimeError):  # detached meanwhile
                    self.session.handles.callback(self._gpu.stop, "the GPU sampler")
                if self.session.detached:
                    self._gpu.stop()
        return self._gpu.read(since)  # type: ignore[return-value]
