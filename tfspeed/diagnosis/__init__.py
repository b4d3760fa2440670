"""Finding the bottleneck: `python -m tfspeed.diagnose`'s measurement and the advice drawn
from it (the profiler window it shares with training is in ``tfspeed.probes``)."""
