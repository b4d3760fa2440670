"""``tfspeed.tune`` as a library: the input-and-step settings of a training job, chosen by
measurement and proven by short real runs.

``tf.data.AUTOTUNE`` sizes parallelism and buffers; it does not decide whether or where to
cache, whether the split should sit in the step, how many steps a call runs or at which
precision. This does, in three phases (the README's "Let tfspeed choose" explains the model):

1. **Measure** (``tuning.measure``), in CPU time per element, the input and the step alone.
2. **Predict** (``tuning.predict``) every candidate's steady-state speed (``predict.rate``).
3. **Verify** (``tuning.verify``) the best few, and the user's own flags, with short runs of
   the real driver; the fastest measured wins. ``tuning.output`` writes ``tuned.flags`` (the
   original flagfile nested, only the changed flags added, each with the measured reason),
   ``tune.json`` (every candidate) and ``tune.png``.

Image storage is the one knob it never turns itself: where reconverting would pay, it
prints the command with the predicted gain.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time

from tfspeed.errors import UsageError
from tfspeed.tuning import measure, output, verify
from tfspeed.tuning.predict import rank
from tfspeed.tuning.verify import MIN_BUDGET_S, Budget

FINISH_S = 2.0  # kept back for writing tuned.flags, tune.json and the chart


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """The tune's own options (its command flags), checked once by ``validate``."""

    budget_s: float = 90.0  # seconds the whole tune may take
    tune_dir: str = ""  # where its outputs go; "": MODEL_DIR/tune
    verify: int = 3  # best predicted candidates to verify by real runs
    measure_to: str = ""  # internal: only measure, into this JSON (the child process)
    deadline: float = 0.0  # internal: with measure_to, the Unix time measuring ends by

    def validate(self) -> TuneOptions:
        if self.verify < 1:
            raise UsageError(f"--verify={self.verify} must be >= 1")
        if self.budget_s < MIN_BUDGET_S and not self.measure_to:
            raise UsageError(f"--budget_s={self.budget_s:g} is too short: measuring and one "
                             f"verifying run take at least ~{MIN_BUDGET_S:.0f} s; give "
                             f"--budget_s={MIN_BUDGET_S:.0f} or more "
                             f"(default {TuneOptions.budget_s:g})")
        return self


def run_command(config, flag_args: list[str], options: TuneOptions) -> dict | None:
    """What ``python -m tfspeed.tune`` does: the whole tune, or in its measuring child
    (``options.measure_to``) only the measurements.

    Args:
      config: the job's resolved config.
      flag_args: the command line's flags as given (the child and ``tuned.flags`` reuse them).
      options: the tune's own options, validated.

    Returns:
      The tune's result (``tune_dir/tune.json``), or None in the measuring child.
    """
    tune_dir = options.tune_dir or os.path.join(config.model_dir, "tune")
    if options.measure_to:
        seconds = options.deadline - time.time() if options.deadline else options.budget_s
        measure.measure_into(options.measure_to, config, Budget(seconds),
                             os.path.join(tune_dir, "work", "probe"))
        # Its JSON is written: the rest of the child's life is tearing down its pipelines
        # and engines (tf.data iterators wait for their threads), which kept the parent
        # waiting ~10 s of the text job's 90 s budget after measuring had ended.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    # The command's start (Python, TensorFlow's import) counts too.
    budget = Budget(options.budget_s, reserve=FINISH_S, already=process_age())
    return run(config, flag_args, options.budget_s, tune_dir, options.verify, budget)


def run(config, flag_args: list[str], budget_s: float, tune_dir: str, verify_n: int,
        budget: Budget | None = None) -> dict:
    """Measures (in a child process given ``flag_args``), predicts, verifies; writes
    tuned.flags, tune.json and tune.png into ``tune_dir``.

    Args:
      budget: the deadline, where it started earlier (the command's own start counts);
        None: ``budget_s`` from now.

    Returns:
      What ``tune.json`` holds (``measurements`` typed), with the chart's path.
    """
    budget = budget or Budget(budget_s, reserve=FINISH_S)
    os.makedirs(tune_dir, exist_ok=True)
    work = os.path.join(tune_dir, "work")
    shutil.rmtree(work, ignore_errors=True)
    m = measure.measure_apart(flag_args, budget, tune_dir)
    ranked = rank(m)
    verifier = verify.Verifier(config, m, ranked, budget, work)
    user = verifier.first_round(ranked, verify_n)
    verified = [r for r in ranked if "measured" in r]
    if not verified and "measured" not in user:
        raise UsageError(f"--budget_s={budget_s:g} left no time to verify a candidate "
                         f"(measuring took {budget.used():.0f} s); raise it")
    if verified:
        verifier.second_round(verified, user)
    # Your flags alone measured (the text job at the default budget on a busy machine):
    # kept, with the measurements and predictions, and what the budget skipped.
    chosen, keep_user = verify.choose(verified, user) if verified else (None, True)
    shutil.rmtree(work, ignore_errors=True)
    return output.write_outputs(tune_dir, config, flag_args, m, ranked, chosen, user, budget,
                                keep_user)


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0
