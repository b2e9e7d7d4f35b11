"""Profiling a watched training: ``torch.profiler`` around the next N steps on request, a
summary that says where the time and memory go, advice with the numbers behind it, and GPU
telemetry from NVML.

>>> handle = session.profile(steps=5)      # returns at once; the training goes on
>>> report = handle.wait(60)               # a ProfileReport
>>> print(report.text())

- :mod:`.capture`: when the profiler runs (step boundaries from the session's bus), its ranges,
  pauses and detach; :mod:`.handle`: what ``session.profile`` returns;
- :mod:`.trace`: the exported Chrome trace and ``key_averages()`` as plain data;
- :mod:`.summary`: from those to the report;
- :mod:`.report`: :class:`ProfileReport`, plain data (what the UI draws, what a dump stores);
- :mod:`.advisor`: rules over a report (plugins: entry-point group ``tensordbg.advisor``);
- :mod:`.nvml`: the GPU sampler.

Importing this package does not import torch; :mod:`.capture` does.
"""

from tensordbg.profiler.report import ProfileReport

__all__ = ["ProfileReport"]
