"""Intra-op threads: over how many cores one op (a matmul, a convolution) splits its work.

TensorFlow's default, one thread per core, hands every op's pieces to other threads and
waits for them. For a tiny model each op is a few microseconds of work and the hand-off
costs more than it saves. With ops on one thread each (two ops still run at once on the
inter-op pool), measured once on a 2-core machine with the engine on in-graph data (not
benchmarked; ``benchmarks/train_step.py`` measures the first row: ``ceiling_1thread``):

  ======================================  ==================  ==================
  model, batch                            forward MFLOP/step  one thread vs TF's
  ======================================  ==================  ==================
  256-256 MLP on the digits, 32           5.6                 faster
  the same, 64                            11                  faster
  the same, 128                           22                  about even
  the same, 256                           44                  slower
  the digits CNN, 64                      192                 slower
  the CNN on 32 px photos, 64             3,100               slower
  ======================================  ==================  ==================

The setting is process-wide and fixed once TensorFlow's runtime starts, so ``auto``
decides before anything runs: it builds the model in a throwaway graph (building runs no
op) and counts the forward pass's FLOPs per replica step with TensorFlow's profiler. Below
``SMALL_STEP_FLOPS`` on a CPU-only host, one thread per op; otherwise TF's default. The
threshold is this machine's crossover; on a host with many more cores it would move, and an
explicit ``--intra_op_threads`` wins.
"""

from __future__ import annotations

import logging as py_logging

from absl import logging

from tfspeed.config import AUTO  # RuntimeConfig.intra_op_threads: decide from the model's size

SMALL_STEP_FLOPS = 16e6  # forward FLOPs per replica step under which one thread wins here


def choose(requested: int | str, forward_flops: float | None, gpus: int,
           environ: str | None = None) -> tuple[int, str]:
    """(intra-op threads to set, 0 for TF's default; the reason), a pure function.

    Args:
      requested: ``--intra_op_threads``: ``AUTO``, 0 (TF's default) or a count.
      forward_flops: the model's forward FLOPs per replica step, None if not counted.
      gpus: GPUs on this host (the step's ops run there, not on the CPU's threads).
      environ: ``TF_NUM_INTRAOP_THREADS`` if set: TensorFlow's own setting, which ``auto``
        leaves alone (an explicit flag still wins).
    """
    if requested != AUTO:
        what = "TF's default (one per core)" if requested == 0 else f"{requested} per op"
        return requested, f"--intra_op_threads={requested}: {what}"
    if environ:
        return 0, f"auto: TF_NUM_INTRAOP_THREADS={environ} is set; TensorFlow applies it"
    if gpus:
        return 0, "auto: the step runs on a GPU; TF's default for the host's ops"
    if forward_flops is None:
        return 0, "auto: the model's size could not be counted; TF's default (one per core)"
    mflop = forward_flops / 1e6
    if forward_flops < SMALL_STEP_FLOPS:
        return 1, (f"auto: a small step ({mflop:.1f} MFLOP forward per replica, under "
                   f"{SMALL_STEP_FLOPS / 1e6:.0f}): one thread per op: no hand-off between "
                   "cores per op, faster for such steps (benchmarks/train_step.py)")
    return 0, (f"auto: {mflop:.0f} MFLOP forward per replica step (at least "
               f"{SMALL_STEP_FLOPS / 1e6:.0f}): ops big enough to split, TF's default")


def forward_flops(build, input_shape, batch: int) -> float | None:
    """FLOPs of one forward pass of ``build()``'s model on a batch of ``batch`` inputs.

    Built and traced in a throwaway graph: no op runs, so TensorFlow's runtime does not
    start and its threads can still be set. None if the model does not build or trace
    there (its real build later reports any error the user must fix).

    Args:
      build: () -> a Keras model.
      input_shape: one input's shape without the batch dimension, or name -> shape.
      batch: examples per replica step.
    """
    import tensorflow as tf

    graph = tf.Graph()
    try:
        with graph.as_default():
            model = build()
            if isinstance(input_shape, dict):
                inputs = {name: tf.zeros([batch, *shape]) for name, shape in input_shape.items()}
            else:
                inputs = tf.zeros([batch, *input_shape])
            model(inputs, training=True)
    except Exception as e:  # noqa: BLE001 -- the real build reports it, with context
        logging.info("intra-op threads: could not count the model's FLOPs (%s)", e)
        return None
    profiler = tf.compat.v1.profiler
    options = (profiler.ProfileOptionBuilder(profiler.ProfileOptionBuilder.float_operation())
               .with_empty_output().build())
    tf_logger = py_logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(py_logging.ERROR)  # the profiler's TF1 deprecation notices
    try:
        return float(profiler.profile(graph, options=options).total_float_ops)
    finally:
        tf_logger.setLevel(level)


def apply(threads: int, requested: int | str = 0) -> int:
    """Sets TensorFlow's intra-op threads (0: leave its default); returns the value in force.

    Only before TensorFlow's runtime starts; afterwards it changes nothing and says so: a
    warning when the user asked for ``threads``, an info line when ``auto`` chose it (a
    notebook or a second run in one process; the report's reason says "not applied" too).
    """
    import tensorflow as tf

    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        except RuntimeError as e:
            say = logging.info if requested == AUTO else logging.warning
            say("--intra_op_threads=%d not applied: %s", threads, e)
    return tf.config.threading.get_intra_op_parallelism_threads()
