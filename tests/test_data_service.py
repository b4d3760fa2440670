"""tf.data service: a real dispatcher and 2 real worker processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import forked
from tfspeed.config import DataConfig
from tfspeed.data import pipeline
from tfspeed.data import service_client as service

REPO = Path(__file__).resolve().parents[1]
RECORDS, FEATURES = 96, 4


class Server:
    """A ``python -m tfspeed.data_service`` process, with the address and server pid it printed."""

    def __init__(self, *args: str, wait: bool = True):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        self.args = args
        self.process = forked.Popen(
            [sys.executable, "-m", "tfspeed.data_service", *args], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if wait:
            self.ready()

    def ready(self) -> Server:
        """Waits for the line that says it serves."""
        line = self.process.stdout.readline()
        match = re.search(r"listening on (grpc://\S+).*\(pid (\d+)\)", line)
        assert match, f"no ready line from data_service {self.args}: {line!r}"
        self.address, self.server_pid = match.group(1), int(match.group(2))
        return self

    @classmethod
    def workers(cls, dispatcher: Server, *ports: int, count: int = 0) -> list[Server]:
        """Worker servers of ``dispatcher``, started together (each starts TensorFlow)."""
        args = [[f"--port={port}"] for port in ports] or [[]] * count
        started = [cls("worker", f"--dispatcher={dispatcher.address}", *extra, wait=False)
                   for extra in args]
        return [server.ready() for server in started]

    @classmethod
    @contextlib.contextmanager
    def fixed_list(cls, work_dir) -> Iterator[Server]:
        """A dispatcher with a fixed list of two workers (what ``file`` sharding needs), all
        stopped at the end; yields the dispatcher."""
        from tfspeed.util.cli import free_ports

        ports = free_ports(2)
        listed = ",".join(f"localhost:{port}" for port in ports)
        dispatcher = cls("dispatcher", "--port=0", f"--work_dir={work_dir}",
                         f"--worker_addresses={listed}")
        servers = [dispatcher]
        try:
            servers += cls.workers(dispatcher, *ports)
            yield dispatcher
        finally:
            for server in reversed(servers):
                server.stop()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A fault-tolerant dispatcher and two supervised workers."""
    work_dir = tmp_path_factory.mktemp("dispatcher")
    dispatcher = Server("dispatcher", "--port=0", f"--work_dir={work_dir}")
    workers = Server.workers(dispatcher, count=2)
    yield dispatcher.address, workers
    for server in [*workers, dispatcher]:
        server.stop()


@pytest.fixture(scope="module")
def numbered_dir(tmp_path_factory) -> str:
    """96 records in 6 shards; record i holds the features 4i..4i+3 (each one is unique)."""
    from tfspeed.convert import convert

    root = tmp_path_factory.mktemp("numbered")
    x = np.arange(RECORDS * FEATURES, dtype=np.float32).reshape(RECORDS, FEATURES)
    np.savez(root / "data.npz", x=x, y=np.arange(RECORDS) % 3)
    convert(f"npz:{root / 'data.npz'}", str(root / "data"), shards=6, validation_fraction=0.0)
    return str(root / "data")


def _first_epoch(data_dir: str, address: str, sharding: str, batch: int = 8,
                 copies: int = 1) -> np.ndarray:
    """The raw feature rows of the first ``RECORDS`` examples trained on via the service,
    after reading ``copies`` x ``RECORDS`` (and a batch more: the end of the epoch)."""
    service.reset_report()
    # deterministic: epochs one after the other (else two overlap, see _through_service).
    config = DataConfig(data_dir=data_dir, batch_size=batch, cache="none", deterministic=True,
                        data_service=address, data_service_sharding=sharding).validate()
    ds = pipeline.build_from_config(config, "train", training=True)
    rows = [x for x, _ in ds.take(copies * RECORDS // batch + 1).as_numpy_iterator()]
    rows = np.concatenate(rows)[:RECORDS]
    # Undo the pipeline's standardisation to get the stored values back.
    return np.rint(rows * _std(data_dir) + _mean(data_dir)).astype(np.int64)


def _stats(data_dir):
    schema = json.loads(Path(data_dir, "schema.json").read_text())
    return schema["stats"]["x"]


def _mean(data_dir):
    return np.asarray(_stats(data_dir)["mean"])


def _std(data_dir):
    return np.asarray(_stats(data_dir)["std"])


def test_dynamic_sharding_delivers_every_record_once_per_epoch(cluster, numbered_dir):
    address, _ = cluster
    rows = _first_epoch(numbered_dir, address, "dynamic")
    expected = np.arange(RECORDS * FEATURES).reshape(RECORDS, FEATURES)
    assert sorted(map(tuple, rows)) == sorted(map(tuple, expected))
    counts = service.report()["train"]
    assert counts["epochs"] >= 1
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    assert counts["delivered"] == counts["expected"] == counts["epochs"] * RECORDS


def test_file_sharding_splits_the_files_between_a_fixed_worker_list(numbered_dir, tmp_path):
    with Server.fixed_list(tmp_path) as dispatcher:
        rows = _first_epoch(numbered_dir, dispatcher.address, "file")
    expected = np.arange(RECORDS * FEATURES).reshape(RECORDS, FEATURES)
    assert sorted(map(tuple, rows)) == sorted(map(tuple, expected))
    counts = service.report()["train"]
    assert counts["lost"] == 0 and counts["duplicated"] == 0


def test_dispatcher_restarted_from_its_work_dir_carries_on(digits_dir, tmp_path):
    from tfspeed.util.cli import free_ports

    port = free_ports(1)[0]
    journal = f"--work_dir={tmp_path}"
    dispatcher = Server("dispatcher", f"--port={port}", journal)
    worker = Server("worker", f"--dispatcher={dispatcher.address}")
    try:
        service.reset_report()
        config = DataConfig(data_dir=digits_dir, batch_size=32, cache="none",
                            data_service=dispatcher.address).validate()
        batches = iter(pipeline.build_from_config(config, "train", training=True))
        for _ in range(20):
            next(batches)
        os.kill(dispatcher.process.pid, signal.SIGKILL)
        dispatcher.process.wait()
        dispatcher = Server("dispatcher", f"--port={port}", journal)  # same port and journal
        for _ in range(150):  # about three epochs more
            next(batches)
    finally:
        # The iterator goes first, while its servers live: destroyed after they stopped, its
        # cancellation waited on a fetch from the dead dispatcher, forever (seen once).
        batches = None
        worker.stop()
        dispatcher.stop()
    counts = service.report()["train"]
    assert counts["epochs"] >= 2
    assert counts["lost"] == 0 and counts["duplicated"] == 0


def test_damaged_shard_on_a_worker_is_counted_or_fails_with_the_fix(cluster, numbered_dir,
                                                                   tmp_path):
    import shutil

    import tensorflow as tf

    from tfspeed.data import integrity

    address, _ = cluster
    data = str(shutil.copytree(numbered_dir, tmp_path / "data"))
    shard = sorted(Path(data).glob("train-*.tfrecord"))[1]
    buf = bytearray(shard.read_bytes())
    frames = integrity.record_offsets(bytes(buf))
    bad = len(frames) // 2
    buf[frames[bad][0] + integrity.HEADER_BYTES + 3] ^= 0xFF  # inside record `bad`
    shard.write_bytes(bytes(buf))

    service.reset_report()
    config = DataConfig(data_dir=data, batch_size=8, cache="none", deterministic=True,
                        data_service=address).validate()
    ds = pipeline.build_from_config(config, "train", training=True)
    list(ds.take(RECORDS // 8).as_numpy_iterator())  # past the end of the first epoch
    counts = service.report()["train"]
    assert counts["epochs"] >= 1
    # The worker cannot read past the damage: the rest of that shard is lost, and counted.
    assert counts["lost"] == counts["epochs"] * (len(frames) - bad)

    failing = DataConfig(data_dir=data, batch_size=8, cache="none", deterministic=True,
                         data_service=address, on_corrupt="fail").validate()
    with pytest.raises(tf.errors.OpError) as error:
        list(pipeline.build_from_config(failing, "train", training=True)
             .take(RECORDS // 8).as_numpy_iterator())
    message = pipeline.corruption_error(error.value)
    assert message and message.startswith(f"tfspeed: shard {shard} ended after {bad} of "
                                          f"{len(frames)} records")
    assert message.endswith(f"`python -m tfspeed.verify {data} --repair`")


def test_augmentation_on_the_service_differs_between_epochs(cluster, photos_dir):
    address, _ = cluster
    config = DataConfig(data_dir=photos_dir, batch_size=1, image_size=16, cache="none",
                        augment=("flip",), deterministic=True,
                        data_service=address).validate()
    n = json.loads(Path(photos_dir, "schema.json").read_text())["splits"]["train"]["num_records"]
    ds = pipeline.build_from_config(config, "train", training=True)
    images = [x[0] for x, _ in ds.take(2 * n).as_numpy_iterator()]
    first, second = images[:n], images[n:]

    def key(image):
        return image.tobytes()

    # Every image of epoch 2 is an image of epoch 1, flipped or not ...
    seen = {key(a) for a in first}
    assert all(key(b) in seen or key(b[:, ::-1]) in seen for b in second)
    # ... but not all flipped the same way: a new draw per epoch (P(same) = 2^-n).
    assert sorted(map(key, first)) != sorted(map(key, second))


def test_sharding_off_gives_each_worker_the_whole_epoch(cluster, numbered_dir):
    address, workers = cluster
    rows = _first_epoch(numbered_dir, address, "off", copies=len(workers))
    assert len(rows) == RECORDS
    counts = service.report()["train"]
    assert counts["epochs"] >= 1
    # Two workers, each producing the whole split: every record twice per epoch.
    assert counts["delivered"] == len(workers) * counts["expected"]


def test_diagnose_measures_input_through_the_service(cluster, digits_dir, tmp_path):
    address, _ = cluster
    result = forked.run(
        [sys.executable, "-m", "tfspeed.diagnose", f"--data_dir={digits_dir}",
         f"--model_dir={tmp_path}", "--model=mlp", "--width=16", "--batch_size=32",
         "--cache=none", f"--data_service={address}", "--diagnose_steps=10",
         "--diagnose_warmup=2", "--steps_per_execution=1", "--eval_split=",
         "--precision=float32"],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    diagnosis = json.loads((tmp_path / "diagnose" / "diagnose.json").read_text())
    assert diagnosis["settings"]["data_service"] == address
    assert diagnosis["verdict"] in ("input-bound", "compute-bound")
    assert diagnosis["examples_per_sec"]["input_alone"] > 0


def test_two_training_workers_share_the_service_each_record_once(cluster, numbered_dir,
                                                                 tmp_path):
    address, _ = cluster
    model_dir = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-m", "tfspeed.launch", "--workers=2", "--",
         f"--data_dir={numbered_dir}", f"--model_dir={model_dir}", "--model=mlp", "--width=8",
         "--batch_size=8", "--train_steps=40", "--steps_per_execution=2", "--cache=none",
         "--eval_split=", "--precision=float32", f"--data_service={address}"],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, capture_output=True,
        text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:]
    report = json.loads((model_dir / "report.json").read_text())
    assert report["input_sharding"].startswith("by file (6 shard files over 2 input pipelines")
    assert "tf.data service" in report["input_sharding"]
    counts = report["data_service"]["splits"]["train"]
    # 40 steps x 8 records = 320 = 3 epochs of 96 and part of a 4th; summed over workers.
    assert counts["epochs"] >= 3
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    assert counts["delivered"] == counts["expected"] >= 3 * RECORDS
    other = re.search(r"worker 1 of 2 finished at update 40: weights sha256 (\w+)", job.stdout)
    assert other and other.group(1) == report["weights_sha256"]


def test_service_needs_a_shard_file_per_training_worker(numbered_dir):
    import tensorflow as tf

    from tfspeed.errors import UsageError

    config = DataConfig(data_dir=numbered_dir, batch_size=8,
                        data_service="grpc://127.0.0.1:5050").validate()
    context = tf.distribute.InputContext(num_input_pipelines=8, input_pipeline_id=0,
                                         num_replicas_in_sync=8)
    with pytest.raises(UsageError, match="needs at least one shard file per worker, and "
                                         "split 'train' has 6: reconvert with --shards=8"):
        pipeline.build_from_config(config, "train", training=True, input_context=context)


def test_worker_killed_mid_epoch_training_finishes_and_reports_loss(cluster, digits_dir,
                                                                    tmp_path):
    """Both workers die mid-run: training finishes, and the records they held are counted
    as lost (never twice).

    The kill must land while the job still needs records the workers hold. Killing at a
    log line raced the trainer: a tiny model trains 150 updates in a second or two, and
    once a loaded machine let the test read the line only after the trainer had fetched
    every record it needed, so nothing was lost (1 failure in 3 full runs). Here the trainer
    waits for the test instead: its output goes to a one-page pipe that the test stops
    reading at the first log, so it blocks in its next log writes, far from the end of the
    run (each update's log line is ~150 bytes; 300 updates logged every 4 write ~11 KB,
    more than the page and what the test has buffered), with the workers holding the rest
    of the epochs in flight."""
    address, workers = cluster
    model_dir = tmp_path / "run"
    train = forked.Popen(
        [sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
         f"--model_dir={model_dir}", "--model=mlp", "--width=16", "--batch_size=32",
         "--train_steps=300", "--steps_per_execution=4", "--log_every=4", "--cache=none",
         "--augment=flip", f"--data_service={address}", "--eval_split=",
         "--precision=float32"],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fcntl.fcntl(train.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    lines = []
    for line in train.stdout:
        lines.append(line)
        if "update 4/" in line:  # training is under way (128 of the epoch's 1,617 records)
            break
    assert train.poll() is None, "".join(lines[-20:])  # it cannot finish: unread output
    for worker in workers:  # whichever holds the rest of the epochs in flight loses it
        os.kill(worker.server_pid, signal.SIGKILL)
    lines += train.stdout.readlines()
    assert train.wait(timeout=300) == 0, "".join(lines[-20:])
    report = json.loads((model_dir / "report.json").read_text())
    assert report["optimizer_updates"] == 300
    counts = report["data_service"]["splits"]["train"]
    assert counts["duplicated"] == 0
    assert counts["delivered"] + counts["lost"] == counts["expected"]
    assert counts["lost"] > 0, counts  # records in flight on the killed workers
    print("service counts after the kill:", counts)
    assert any(f"{counts['lost']} lost" in line or "lost (a service worker" in line
               for line in lines)
    for worker in workers:
        worker.server_pid = _restarted_pid(worker)


def _restarted_pid(server: Server, timeout: float = 30.0) -> int:
    """The pid of the server the supervisor started again (its child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
        pids = children.read_text().split()
        if pids and int(pids[0]) != server.server_pid:
            return int(pids[0])
        time.sleep(0.2)
    raise AssertionError("the supervisor did not restart the killed worker")


def _train(args, cwd=REPO):
    result = forked.run([sys.executable, "-m", "tfspeed.train", *args], cwd=cwd,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
    return result.returncode, result.stderr.strip().splitlines()


def test_unreachable_dispatcher_is_one_line(digits_dir, tmp_path):
    from tfspeed.util.cli import free_ports

    port = free_ports(1)[0]
    code, err = _train([f"--data_dir={digits_dir}", f"--model_dir={tmp_path}",
                        f"--data_service=grpc://127.0.0.1:{port}"])
    assert code == 2
    assert err[-1].startswith(f"error: no tf.data service dispatcher at grpc://127.0.0.1:{port}")
    assert "python -m tfspeed.data_service dispatcher" in err[-1]


@pytest.mark.parametrize("address", ["127.0.0.1", "http://127.0.0.1:5050", "grpc://host:x"])
def test_bad_service_address_is_a_usage_error(address):
    from tfspeed.errors import UsageError

    with pytest.raises(UsageError, match="is not a dispatcher address; use grpc://HOST:PORT"):
        DataConfig(data_dir="d", data_service=address).validate()


def test_worker_without_dispatcher_is_one_line():
    result = subprocess.run([sys.executable, "-m", "tfspeed.data_service", "worker"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: worker needs --dispatcher=HOST:PORT, the address the dispatcher printed")
