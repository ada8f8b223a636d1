"""The supervised worker: backends run in a child process that the harness watches and replaces.

A backend may raise anything, exit, abort, segfault, hang or corrupt its device; none of that may end
or stall the run. `Supervisor.execute` sends one case to the worker and waits at most `timeout`
seconds: a death (exit code or signal) or a timeout becomes that case's `Failure` (with the worker's
last output), the worker is killed and a fresh one takes the next case. Workers are forked by the fork server
(harness/execution/fork_server.py), which has imported torch, so a start costs milliseconds, not a new Python (about
2 CPU-seconds); from the first death on a spare is also kept started. The worker runs in its
own session, so a Ctrl-C reaches only the harness, which then stops it. Messages are length-prefixed
pickles on two pipes of their own; the backend's prints go to a third pipe, kept as a log tail.

  harness.execution.fork_server.start("moe_lora_harness.harness.execution.worker:_worker_main", pass_fds=(FD_IN, FD_OUT))
  # started by Supervisor, never by hand
"""
from __future__ import annotations

import collections
import os
import pickle
import select
import signal
import struct
import threading
import time

from moe_lora_harness.harness.execution import fork_server

DEFAULT_TIMEOUT = 300.0     # seconds per backend call (first calls compile kernels); --timeout changes it
START_TIMEOUT = 180.0       # seconds for a new worker to import torch and report ready
_HEADER = struct.Struct(">Q")
_LOG_LINES = 60
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")   # torch's intra-op threads (OpenMP, MKL)


def share_cores(env: dict, processes: int) -> None:
    """Give each of `processes` processes that run at once its share of the cores for torch's threads (in `env`,
    unless it sets them): oversubscribed threads cost more than they give (a 5x64 by 64x8 float64 GEMM took
    5 us with one thread and 150-400 us with two on a loaded 2-core machine)."""
    share = str(max(1, (os.cpu_count() or 1) // max(1, processes)))
    for var in THREAD_VARS:
        env.setdefault(var, share)


def child_env(base: dict | None = None) -> dict:
    """The environment of a process the harness starts (worker, EP rank): `base` (default os.environ) with
    the package importable first on PYTHONPATH (also from a source tree not installed), output unbuffered."""
    import moe_lora_harness
    root = os.path.dirname(os.path.dirname(os.path.abspath(moe_lora_harness.__file__)))
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class WorkerDied(Exception):
    """The worker ended (or went silent) while a case was in flight."""


def _write_msg(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_msg(fd: int, deadline: float | None):
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"


class _Process:
    """One worker process: its pipes, its output pump and log tail; started at once (forked by the fork server),
    ready when it says so."""

    def __init__(self, env: dict):
        log_r, log_w = os.pipe()
        self.log: collections.deque = collections.deque(maxlen=_LOG_LINES)
        self.log_lock = threading.Lock()
        self.ready = self.killed = False
        self.proc, self.send_fd, self.recv_fd = fork_server.start_talking(
            "moe_lora_harness.harness.execution.worker:_worker_main", env=env, output=log_w)
        threading.Thread(target=self._pump, args=(os.fdopen(log_r, "rb"),), daemon=True).start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            with self.log_lock:
                self.log.append(raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def log_tail(self) -> str:
        with self.log_lock:
            return "\n".join(self.log)

    def wait_ready(self) -> None:
        """Block until the worker has imported what it needs (or fail with its output)."""
        if self.ready:
            return
        try:
            msg = _read_msg(self.recv_fd, time.monotonic() + START_TIMEOUT)
        except (EOFError, TimeoutError, OSError) as e:
            log = self.log_tail()
            self.kill()
            raise RuntimeError(f"the backend worker did not start ({type(e).__name__}); its output:\n{log}") from None
        if msg != "ready":
            self.kill()
            raise RuntimeError(f"the backend worker sent {msg!r} instead of 'ready'")
        self.ready = True

    def kill(self) -> None:
        """Kill the worker's process group and close its pipes; once (a second call must not close fds that
        were reused meanwhile)."""
        if self.killed:
            return
        self.killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the worker and anything its backend started
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for fd in (self.send_fd, self.recv_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def executor_for(in_process: bool, timeout: float | None):
    """Where backend calls run: in this process (a debugger's run, --in-process) or a Supervisor's worker."""
    if in_process:
        from moe_lora_harness.harness.execution.execute import InProcess
        return InProcess()
    return Supervisor(timeout=timeout)


class Supervisor:
    """One worker process at a time, started on first use and replaced after a death or a timeout.

    After the first death a spare worker is kept started beside it (`spare=True`), so a backend that crashes
    or hangs often costs a worker start once, not at every death."""

    supervised = True

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None, spare: bool = True):
        self.timeout = float(timeout)
        self.env = dict(os.environ if env is None else env)
        self.keep_spare = spare
        self._w: _Process | None = None
        self._spare: _Process | None = None
        self._died = False
        self.starts = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        """Workers that took over after the first (each one replaced a dead, hung or poisoned worker)."""
        return max(0, self.starts - 1)

    @property
    def proc(self):
        """The worker process cases go to, a Popen-like handle (None between a death and the next case)."""
        return self._w.proc if self._w is not None else None

    def _start(self) -> None:
        """Make a worker the active one: the spare if one is started (a fresh spare then starts beside it)."""
        w, self._spare = self._spare, None
        if w is not None and w.proc.poll() is not None:
            w.kill()
            w = None
        w = w or _Process(child_env(self.env))
        self.starts += 1
        try:
            w.wait_ready()
        except BaseException:
            w.kill()
            raise
        self._w = w
        if self.keep_spare and self._died:
            self._spare = _Process(child_env(self.env))     # imports while the active worker works

    def log_tail(self) -> str:
        return self._w.log_tail() if self._w is not None else ""

    def _kill(self) -> None:
        w, self._w = self._w, None
        if w is not None:
            w.kill()
            self._died = True

    def close(self) -> None:
        """Stop the worker and the spare (also what a Ctrl-C in the harness does)."""
        self._kill()
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one case -------------------------------------------------------------------------------------
    def execute(self, spec, case, device: str, poison=None):
        """Run `spec` (loaded in the worker from `spec.origin`) on `case`; never raises for the backend's sake."""
        from moe_lora_harness.harness.execution.execute import Execution
        return self._request(spec, ("run", case.to_json(), device, poison), Execution)

    def execute_scenario(self, spec, scenario, device: str, start: int = 0):
        """Steps `start:` of a layer scenario on the worker's live layer (harness.execution.layer_execute); a death or a
        timeout is the failure of the steps in flight."""
        from moe_lora_harness.harness.execution.layer_execute import ScenarioExecution
        ex = self._request(spec, ("scenario", scenario.to_json(), device, start), ScenarioExecution)
        if ex.failure is not None and ex.failure.kind in ("timeout", "crash") and ex.failed_step is None:
            ex.failed_step = len(scenario.steps) - 1
        return ex

    def _request(self, spec, what: tuple, result_type):
        from moe_lora_harness.harness.execution.execute import Failure
        Execution = result_type
        if not spec.origin:
            raise ValueError(f"backend {spec.name!r} has no origin: a supervised run loads backends by reference "
                             f"(load it with harness.spec.registry, or run in-process)")
        if self._w is not None and self._w.proc.poll() is not None:
            self._kill()     # died between cases
        if self._w is None:
            self._start()
        w = self._w
        with w.log_lock:
            w.log.clear()
        t0 = time.monotonic()
        try:
            setup = spec.setup if isinstance(spec.setup, str) else None   # e.g. from --setup
            kind, payload, device, extra = what
            _write_msg(w.send_fd, (kind, spec.origin, spec.name, payload, device, extra, setup))
            ex = _read_msg(w.recv_fd, t0 + self.timeout)
        except TimeoutError:
            log = self.log_tail()
            self._kill()
            return Execution(failure=Failure("timeout", f"no result within {self.timeout:g}s (the worker was "
                                                        f"killed; --timeout sets the limit)", fatal=True),
                             seconds=time.monotonic() - t0, log=log)
        except (EOFError, BrokenPipeError, OSError):
            code = w.proc.wait()
            time.sleep(0.05)   # let the log pump take the last lines
            log = self.log_tail()
            self._kill()
            why = _describe_exit(code) if code is not None else "ended"
            return Execution(failure=Failure("crash", f"the worker {why} during the call", exc_type=why.split()[-1],
                                             fatal=True), seconds=time.monotonic() - t0, log=log)
        except BaseException:
            self.close()     # Ctrl-C or an error of ours: no worker is left behind, nor a spare
            raise
        ex.log = self.log_tail()
        if ex.failure is not None and ex.failure.fatal:
            self._kill()     # e.g. a CUDA error: the next case gets a fresh device context
        return ex


# -- the worker process ---------------------------------------------------------------------------------

PROFILE_VAR = "MOE_LORA_HARNESS_WORKER_PROFILE"   # a folder: each worker cProfiles its requests into it (bench/)


def _request_profile():
    """A cProfile.Profile for the worker's requests where PROFILE_VAR names a folder (a benchmark's look at the
    worker's side of a supervised run), else None."""
    if not os.environ.get(PROFILE_VAR):
        return None
    import cProfile
    return cProfile.Profile()


WORKER_NAME = "moe-lora-worker"    # the worker's process name (ps -o comm; a forked worker shares its server's command)


def _worker_main(fd_in: int, fd_out: int) -> None:
    import faulthandler
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(WORKER_NAME)
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the supervisor's to handle
    faulthandler.enable()                           # a segfault prints the Python stack into the log
    from moe_lora_harness.harness.spec.case import Case
    from moe_lora_harness.harness.execution.execute import Execution, Failure, execute
    from moe_lora_harness.harness.spec.registry import load_ref
    loaded: dict = {}
    profile = _request_profile()
    _write_msg(fd_out, "ready")
    while True:
        try:
            msg = _read_msg(fd_in, None)
        except EOFError:
            return
        kind, origin, name, payload, device, extra, setup = msg
        if kind == "scenario":
            from moe_lora_harness.harness.execution.layer_execute import ScenarioExecution as Result
        else:
            Result = Execution
        try:
            if origin not in loaded:
                loaded[origin] = {s.name: s for s in load_ref(origin)}
            spec = loaded[origin].get(name)
            if spec is None:
                raise LookupError(f"{origin} no longer provides a backend named {name!r}")
            if setup and spec.setup is None:
                import dataclasses
                spec = loaded[origin][name] = dataclasses.replace(spec, setup=setup)
        except BaseException as e:  # noqa: BLE001 - a reference that fails to load here is reported, not fatal
            _write_msg(fd_out, Result(failure=Failure("load", f"{type(e).__name__}: {e}", type(e).__name__)))
            continue
        if profile is not None:
            profile.enable()
        if kind == "scenario":
            from moe_lora_harness.harness.execution.layer_execute import execute_scenario
            from moe_lora_harness.harness.build.layer_scenario import Scenario
            result = execute_scenario(spec, Scenario.from_json(payload), device, extra)
        else:
            result = execute(spec, Case.from_json(payload), device, extra)
        if profile is not None:
            profile.disable()
            profile.dump_stats(os.path.join(os.environ[PROFILE_VAR], f"worker-{os.getpid()}.prof"))
        try:
            _write_msg(fd_out, result)
        except Exception as e:  # noqa: BLE001 - e.g. an output that does not pickle
            _write_msg(fd_out, Result(failure=Failure("worker", f"result could not be sent: {e}")))
