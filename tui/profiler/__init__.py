"""The profiler's tabs: where the time and memory of the profiled steps went, and what to change.

Every tab draws from the plain dict of a profile report (``profile_report()``); only the GPU tab
asks the training for more (``gpu()``, while it is on screen). :class:`ProfilerView` holds them.
"""
