"""Measuring to choose: `python -m tfspeed.tune`'s measure, predict, verify and output (the
in-run autotuners they share with training are in ``tfspeed.probes``)."""
