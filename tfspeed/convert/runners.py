"""Runners: who writes a conversion's shards. The "what" (the shard tasks, their chunks and
`writer.write_shard`) is shared; a runner only decides where the writing happens.

  LocalRunner  this process, with workers - 1 worker processes beside it: the default
  BeamRunner   an Apache Beam pipeline: the DirectRunner on this machine, or Dataflow, Flink or
               Spark, chosen by Beam's own options (``--beam_options="--runner=FlinkRunner ..."``)

Every runner writes each shard with `write_shard` (temporary file, fsync, rename, sha256) and
records it in the `Manifest` right after its rename. So both give the same bytes, and a conversion
killed under one resumes under either, keeping the shards already recorded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import logging
import shlex
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from tfspeed.convert import pool as pool_lib
from tfspeed.convert import writer
from tfspeed.convert.plan import Manifest
from tfspeed.convert.sources import Chunk
from tfspeed.data.schema import Schema
from tfspeed.errors import UsageError

RUNNERS = ("local", "beam")
BEAM_INSTALL = "pip install 'tfspeed[beam]'"


class Runner(Protocol):
    """Writes shard tasks."""

    def started(self, expected_tasks: int) -> contextlib.AbstractContextManager:
        """Holds what the runner needs (worker processes) ready while the block runs."""

    def write(
        self,
        plan: Manifest,
        tasks: Sequence[writer.ShardTask],
        make_chunk: Callable[[str, int, int], Chunk],
        template: Schema,
        *,
        on_result: Callable[[writer.ShardResult], None],
        on_record: Callable[[], None] | None = None,
    ) -> None:
        """Writes ``tasks``, recording each finished shard in ``plan``.

        Args:
          plan: the conversion's plan; its ``out_dir`` receives the shards.
          tasks: the shards to write.
          make_chunk: ``(split, start, stop) -> Chunk``, called in this process.
          template: the schema whose features encode the records.
          on_result: called in this process with each shard once it is recorded.
          on_record: called after each source item, where the runner can tell (progress).
        """


def make_runner(name: str, *, workers: int = 1, beam_options: str = "") -> Runner:
    """The runner called ``name`` (``local`` or ``beam``); a UsageError for bad options.

    Args:
      name: ``local`` or ``beam``.
      workers: the local runner's processes.
      beam_options: Beam pipeline options as one shell-quoted string, for ``beam``.

    Returns:
      A `Runner`, its options checked.
    """
    if name == "local":
        if beam_options:
            raise UsageError(
                f"--beam_options={beam_options!r} needs --runner=beam; drop it or add --runner=beam"
            )
        return LocalRunner(workers)
    if name == "beam":
        return BeamRunner.from_options(beam_options)
    raise UsageError(f"--runner={name}: use one of {', '.join(RUNNERS)}")


@dataclasses.dataclass
class LocalRunner:
    """Writes with ``workers`` writers: this process and ``workers - 1`` worker processes."""

    workers: int = 1
    pool: concurrent.futures.Executor | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @contextlib.contextmanager
    def started(self, expected_tasks: int) -> Iterator[None]:
        """Starts the worker processes now (up to ``expected_tasks`` of them), so that their
        start-up overlaps with listing the source; stops them when the block ends."""
        helpers = self.workers - 1  # this process writes shards too
        pool = pool_lib.start_pool(helpers, min(helpers, expected_tasks)) if helpers else None
        self.pool, finished = pool, False
        try:
            yield
            finished = True
        finally:
            self.pool = None
            if pool and finished:
                pool.shutdown()
            elif pool:
                pool_lib.stop_now(pool)

    def write(self, plan, tasks, make_chunk, template, *, on_result, on_record=None) -> None:
        def done(result: writer.ShardResult) -> None:
            plan.record(result)  # only after its rename: a recorded shard is a complete file
            on_result(result)

        pool_lib.write_shards(
            plan.out_dir,
            tasks,
            make_chunk,
            template,
            workers=self.workers,
            on_result=done,
            on_record=on_record,
            pool=self.pool,
        )


@dataclasses.dataclass(frozen=True)
class BeamRunner:
    """Writes through an Apache Beam pipeline: Create(tasks) | Reshuffle | Map(write a shard).

    The output directory must be a file system every Beam worker and this process see (local
    disk for the DirectRunner; a shared mount for a cluster): shards are renamed into place and
    recorded in the plan with POSIX calls, by the worker that wrote them.

    Attributes:
      argv: Beam pipeline options, e.g. ``("--direct_num_workers=2",)``.
    """

    argv: tuple[str, ...] = ()

    def started(self, expected_tasks: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # Beam starts its workers itself

    @classmethod
    def from_options(cls, text: str) -> BeamRunner:
        """Parses ``text`` (shell-quoted Beam options); a one-line UsageError if Beam would not
        run them: Beam missing, bad quoting, a bad value, an unknown runner or option."""
        _import_beam()
        from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
        from apache_beam.runners.runner import create_runner

        try:
            argv = tuple(shlex.split(text))
        except ValueError as e:
            raise UsageError(f"--beam_options={text!r}: {e}; check its quotes") from None
        options = PipelineOptions(list(argv))
        runner = options.view_as(StandardOptions).runner or "DirectRunner"
        try:
            create_runner(runner)  # also imports the runner's module, which may add options
        except ValueError as e:
            raise UsageError(
                f"--beam_options={text!r}: {str(e).split('. ')[0]}; use e.g. DirectRunner, "
                "DataflowRunner, FlinkRunner or SparkRunner"
            ) from None
        parsers, argparse_said = [], io.StringIO()
        try:
            # Beam parses with argparse, which exits (status 2) on a bad value; it warns about
            # unknown options and drops them, but a typo must not silently change the run.
            with (
                _quiet("apache_beam.options.pipeline_options", "Discarding"),
                contextlib.redirect_stderr(argparse_said),
            ):
                options.get_all_options(add_extra_args_fn=parsers.append)
        except SystemExit:
            reason = argparse_said.getvalue().strip().splitlines()[-1].partition("error: ")[2]
            raise UsageError(f"--beam_options={text!r}: {reason}") from None
        _, unknown = parsers[0].parse_known_args(list(argv))
        if unknown:
            raise UsageError(f"--beam_options={text!r}: {unknown[0]!r} is not a Beam option")
        return cls(argv)

    def write(self, plan, tasks, make_chunk, template, *, on_result, on_record=None) -> None:
        if not tasks:
            return
        beam = _import_beam()
        from apache_beam.options.pipeline_options import PipelineOptions

        # Chunks are made here, as for the local pool: listing stays in this process, and a
        # chunk (file names or an array slice) is what a worker needs to write its shard.
        work = [(task, make_chunk(task.split, task.start, task.stop)) for task in tasks]
        with beam.Pipeline(options=PipelineOptions(list(self.argv))) as pipeline:
            _ = (
                pipeline
                | "ShardTasks" >> beam.Create(work)
                # Without it Create's single bundle fuses with the writes: one worker does all.
                | "Spread" >> beam.Reshuffle()
                | "WriteShard" >> beam.Map(_write_and_record, plan, template)
            )
        recorded = plan.recorded()  # the workers' results, in the plan they appended to
        for task in tasks:
            if task.file not in recorded:
                raise RuntimeError(f"the Beam pipeline finished without recording {task.file}")
            on_result(recorded[task.file])


def _write_and_record(
    work: tuple[writer.ShardTask, Chunk], plan: Manifest, template: Schema
) -> writer.ShardResult:
    """Runs on a Beam worker: writes one shard, then records it (after its rename)."""
    task, chunk = work
    result = writer.write_shard(plan.out_dir, task.file, chunk, template)
    plan.record(result)
    return result


def _import_beam():
    """Imports ``apache_beam``, or raises a UsageError saying how to install it."""
    # Importing Beam logs a note about an optional BigQuery client (apitools) on the root logger.
    with _quiet("", "apitools not found"):
        try:
            import apache_beam
        except ImportError as e:
            raise UsageError(f"--runner=beam needs Apache Beam: {BEAM_INSTALL} ({e})") from None
    return apache_beam


@contextlib.contextmanager
def _quiet(logger: str, text: str) -> Iterator[None]:
    """Drops the records of ``logger`` that contain ``text`` while the block runs."""

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    log, guard = logging.getLogger(logger), logging.NullHandler()
    log.addFilter(keep)
    log.addHandler(guard)  # a logger without handlers would get a stderr one from warning()
    try:
        yield
    finally:
        log.removeHandler(guard)
        log.removeFilter(keep)
