"""Measuring to choose: the in-run autotuners (steps per execution, precision) and
`python -m tfspeed.tune`'s measure, predict, verify and output."""
