"""``python -m tfspeed.tune --flagfile=X.flags [--budget_s=90]``: the input-and-step settings
of a training job, chosen by measurement and proven by short real runs.

A command only: parse the flags into a ``Config`` and the tune's options, then one library
call, ``tfspeed.tuning.tune.run_command`` (measure, predict, verify, output: see there).
"""

from __future__ import annotations

from absl import app, flags

from tfspeed import runtime
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.tuning.tune import TuneOptions, run_command
from tfspeed.util.cli import exit_on_help, flags_usage, main_entry

_BUDGET_S = flags.DEFINE_float("budget_s", TuneOptions.budget_s,
                               "Seconds the whole tune may take.")
_TUNE_DIR = flags.DEFINE_string("tune_dir", TuneOptions.tune_dir, "Where tuned.flags, "
                                "tune.json and tune.png go; default MODEL_DIR/tune.")
_VERIFY = flags.DEFINE_integer("verify", TuneOptions.verify,
                               "Best predicted candidates to verify by real runs.")
_MEASURE_TO = flags.DEFINE_string("measure_to", TuneOptions.measure_to,
                                  "Internal: only measure, into this JSON.")
_DEADLINE = flags.DEFINE_float("deadline", TuneOptions.deadline, "Internal: with "
                               "--measure_to, the Unix time by which measuring ends (TF's "
                               "start in the child counts).")

_ARGS: list[str] = []  # the command line's flags as given: the child and tuned.flags reuse them


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    if not runtime.backends.current().tf_function_probes:
        raise UsageError(
            f"KERAS_BACKEND={runtime.backend()}: tune times its candidates with TensorFlow's "
            "step (tf.function probes); run it with KERAS_BACKEND=tensorflow. On JAX the "
            "driver's own auto settings (--steps_per_execution, --batching, "
            "--input_placement) still measure and decide in the run")
    options = TuneOptions(budget_s=_BUDGET_S.value, tune_dir=_TUNE_DIR.value,
                          verify=_VERIFY.value, measure_to=_MEASURE_TO.value,
                          deadline=_DEADLINE.value).validate()
    run_command(tfspeed_flags.to_config(), list(_ARGS), options)


def _parse(argv: list[str]) -> list[str]:
    _ARGS[:] = argv[1:]
    return tfspeed_flags.parse(argv)


def _usage() -> str:
    # --measure_to and --deadline are the tune's own (its measuring child): not listed.
    return flags_usage(__doc__, {**tfspeed_flags.help_groups(),
                                 "tune": [_BUDGET_S, _TUNE_DIR, _VERIFY]})


def run_main() -> None:
    """Console entry point: one-line errors with exit status 2 for user mistakes."""
    exit_on_help(_usage)
    main_entry(lambda: app.run(main, flags_parser=_parse))


if __name__ == "__main__":
    run_main()
