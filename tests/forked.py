"""Python processes forked from a template that has imported TensorFlow and Keras.

Every TensorFlow process starts by importing TensorFlow and Keras: about 6 CPU-s on a 2-core
host, more than many of the suite's commands then spend. ``Popen`` is ``subprocess.Popen``
for ``[sys.executable, ...]`` whose process is forked off a template that has made those
imports and nothing else (no op run, no runtime, no tfspeed module), as multiprocessing's
forkserver does; ``run`` is ``subprocess.run`` over it. The process is one of its own: its
pid, exit status and signals, its stdin, stdout and stderr (the pipes ``subprocess`` made),
its cwd and environment are its own, and it runs the module, script or code as ``python``
would (``runpy``), importing tfspeed afresh.

It is not ``python`` started afresh, so tests of what a fresh interpreter does stay on
``subprocess``: what an import imports, the hash seed, peak memory. An environment that
differs from a template's in anything read at import (TF_*, KERAS_*, JAX_*, XLA_*, PYTHON*,
CUDA_*, ...) gets a template of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import threading
import types

# Read when TensorFlow, Keras, JAX or Python start: a template serves one set of them.
# PYTHONPATH aside: each process's sys.path is its own.
_AT_IMPORT = ("TF_", "KERAS_", "JAX_", "XLA_", "PYTHON", "CUDA_", "LD_", "OMP_", "MKL")
_MESSAGE = 1 << 20


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_AT_IMPORT) and k != "PYTHONPATH"))


class _Template:
    """A template process, the socket its requests go through and the exit statuses it
    reports (a thread reads them)."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                        env=env, pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.socket, self.changed = ours, threading.Condition()
        self.pids: dict[int, int] = {}  # request number -> pid
        self.statuses: dict[int, int] = {}  # pid -> exit status
        self.requests = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.socket.recv(_MESSAGE)
            except OSError:  # closed at exit
                message = b""
            if not message:
                break
            reply = json.loads(message)
            with self.changed:
                if "status" in reply:
                    self.statuses[reply["pid"]] = reply["status"]
                else:
                    self.pids[reply["request"]] = reply["pid"]
                self.changed.notify_all()
        with self.changed:  # the template ended
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, args: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> int:
        with self.changed:
            self.requests += 1
            number = self.requests
        request = {"request": number, "args": args, "cwd": cwd, "env": env}
        socket.send_fds(self.socket, [json.dumps(request).encode()], fds)
        with self.changed:
            # The first request waits for the template's imports: tens of seconds on a busy host.
            if not self.changed.wait_for(lambda: number in self.pids or not self.alive(), 600):
                raise RuntimeError("the template process did not fork")
            if number not in self.pids:
                raise RuntimeError(f"the template process ended ({self.process.poll()})")
            return self.pids.pop(number)

    def status(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.statuses or not self.alive(), timeout)
            return self.statuses.pop(pid, None)  # kept by the Popen as its returncode


_TEMPLATES: dict[tuple, _Template] = {}
_LOCK = threading.Lock()


def _template(env: dict[str, str]) -> _Template:
    key = _key(env)
    with _LOCK:
        template = _TEMPLATES.get(key)
        if template is None or not template.alive():
            template = _TEMPLATES[key] = _Template(env)
        return template


@atexit.register
def _stop_templates() -> None:
    for template in _TEMPLATES.values():
        template.socket.shutdown(socket.SHUT_RDWR)  # (a close would wait for the reader)
        template.socket.close()
        template.process.wait(timeout=30)


class Popen(subprocess.Popen):
    """``subprocess.Popen([sys.executable, *args], ...)`` in a process forked off a template.
    ``pass_fds``, ``preexec_fn``, users and groups are not taken."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, *_):
        args = [os.fspath(a) for a in args]
        if args[0] != sys.executable or pass_fds or preexec_fn or shell:
            raise ValueError(f"forked.Popen runs [sys.executable, ...] as it is: {args[:2]}")
        env = dict(os.environ if env is None else env)
        fds = [fd if fd != -1 else default for fd, default in
               ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        self._template = _template(env)
        try:
            self.pid = self._template.start(args[1:], os.fspath(cwd or os.getcwd()), env, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None:
            self.returncode = self._template.status(self.pid, 0)
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is None:
            self.returncode = self._template.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run(command: list[str], *, cwd=None, env: dict[str, str] | None = None,
        timeout: float | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout, input=input)`` (``command``: ``[sys.executable, ...]``), forked."""
    stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
    with Popen(command, cwd=cwd, env=env, stdin=stdin, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


# ------------------------------------------------------------------ the template process


def _serve(fd: int) -> None:
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    requests = socket.socket(fileno=fd)
    given = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base_path = [p for p in sys.path[1:] if p not in given]  # less this file's folder
    children = set()
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05 if children else None)
        if ready:
            message, fds, _, _ = socket.recv_fds(requests, _MESSAGE, 3)
            if not message:
                return  # the suite's process ended
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                requests.close()
                _child(request, fds, base_path)  # never returns
            for given_fd in fds:
                os.close(given_fd)
            children.add(pid)
            requests.send(json.dumps({"request": request["request"], "pid": pid}).encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                requests.send(json.dumps({"pid": pid, "status": code}).encode())


def _child(request: dict, fds: list[int], base_path: list[str]) -> None:
    import runpy

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        args = request["args"]
        if args[0] == "-m":
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.path[:] = ["", *extra, *base_path]
            sys.argv = ["-c", *args[2:]]
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(args[0])
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *extra, *base_path]
            sys.argv = list(args)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        # As Python prints it: from the code run on, without this file's and runpy's frames.
        tb, ours = e.__traceback__, (__file__, runpy.__file__, "<frozen runpy>")
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    finally:
        # As the interpreter ends: non-daemon threads joined, then atexit, then the streams.
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
