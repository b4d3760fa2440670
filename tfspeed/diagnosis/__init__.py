"""Finding the bottleneck: `python -m tfspeed.diagnose`'s measurement, the advice drawn from
it, and the profiler window."""
