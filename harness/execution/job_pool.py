"""`check --jobs N` and `selftest --jobs N`: a plan's runs handed out to N job processes, one report in the parent.

The parent keeps the plan; a job gets the command's options once and then one run at a time (what to run, not an
index into a plan of its own, so a job needs no plan and cannot build another one), as jobs become free, in the
order the caller gives (the longest runs first, so that none is left alone at the end), and sends back the run's
result and seconds. Jobs are forked by the fork server (harness.execution.fork_server: torch imported, CUDA never touched;
never the parent, which may have), so a job starts in milliseconds, in its own session, and may use the GPU; each
builds its own executor (a supervised worker). The cores are shared as for
`fuzz --jobs` (harness.execution.worker.share_cores). A job that raises reports its traceback (a harness error: no run is
handed out after it); a job that dies has its run given once to a fresh job, and a second death running it is a
harness error. On Ctrl-C each job is interrupted (it stops its worker): what finished is kept, the runs in flight
are named. The caller's `task(i)` may refuse the next run (--budget): nothing is handed out after it.

  served = serve("moe_lora_harness.harness.front.cli:check_job", options, len(plan), 4, task=..., finished=...)
"""
from __future__ import annotations

import argparse
import collections
import importlib
import itertools
import os
import pathlib
import select
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field

from moe_lora_harness.harness.execution import fork_server
from moe_lora_harness.harness.draw.profiles import on_gpu
from moe_lora_harness.harness.execution.worker import _describe_exit, _read_msg, _write_msg, child_env, share_cores

AUTO_MAX_JOBS = 8       # --jobs auto on a GPU host: half the cores, at most this many
GRACE_S = 30.0          # after a Ctrl-C, how long jobs get to stop their workers before they are killed
_LOG_TAIL = 3000


def jobs_arg(text: str):
    """--jobs: a positive count, or 'auto'."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or auto; got {text!r}")
    return n


def resolve_jobs(asked, device: str, *, heavy: bool = False, in_process: bool = False) -> int:
    """The job count: --jobs N as given; auto is 1 on the CPU, for production-size runs (`heavy`: --model) and
    --in-process (a debugger's run), else min(8, half the cores)."""
    if asked != "auto":
        return int(asked)
    if heavy or in_process or not on_gpu(device):
        return 1
    return min(AUTO_MAX_JOBS, max(1, (os.cpu_count() or 1) // 2))


@dataclass
class Served:
    """How a `serve` ended: runs never handed out, runs in flight when it stopped, harness errors, job stats."""

    not_handed: list = field(default_factory=list)   # plan indices never handed out, in plan order
    in_flight: list = field(default_factory=list)    # indices running when it stopped (Ctrl-C), in plan order
    errors: list = field(default_factory=list)       # (index or None, text): a job raised, died twice, failed to start
    interrupted: bool = False
    stats: list = field(default_factory=list)        # each job's close() value
    deaths: int = 0                                  # jobs that died in the middle (their run given to a fresh job)


class _Job:
    """The parent's side of one job process: its pipes, its log file, the run it has (None: idle)."""

    def __init__(self, number: int, target: str, options, env: dict, log_dir: pathlib.Path):
        self.log = log_dir / f"job-{number}.log"
        log_fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.proc, self.send_fd, self.recv_fd = fork_server.start_talking(
            "moe_lora_harness.harness.execution.job_pool:_job_main", env=env, output=log_fd)
        self.running: int | None = None
        self.closing = self.closed = False
        try:
            _write_msg(self.send_fd, (target, options))
        except OSError:
            pass          # it died at once: its end of file is read next

    def send(self, msg) -> bool:
        try:
            _write_msg(self.send_fd, msg)
            return True
        except OSError:
            return False

    def close_request(self) -> None:
        """No more runs: the job stops its executor, sends its stats and exits."""
        if not self.closing:
            self.closing = True
            self.send(None)

    def interrupt(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            return ""

    def end(self, kill: bool = False) -> int | None:
        """Reap the process (killed with its group first when `kill`, or when it does not exit), close the pipes."""
        if self.closed:
            return self.proc.returncode
        self.closed = True
        if kill:
            self._killpg()
        try:
            code = self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not exit after its end of file
            self._killpg()
            code = self.proc.wait()
        for fd in (self.send_fd, self.recv_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        return code

    def _killpg(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # the job is its session's leader
        except (ProcessLookupError, PermissionError):
            pass


def serve(target: str, options, count: int, jobs: int, *, task, finished, started=None, order=None) -> Served:
    """Runs 0..count-1 in `jobs` processes: `target` ("module:function") builds a job's runner from `options` (it
    has run(what) -> result and close() -> stats); `task(i)` gives what run i is (picklable), or None to hand out
    nothing more; `started(i)` is told as it is handed out, `finished(i, result, seconds)` as its result comes.
    They are handed out in `order` (default: 0, 1, ...)."""
    served = Served()
    pending = collections.deque(range(count) if order is None else order)
    retried: set = set()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="moe-lora-jobs-"))
    env = child_env()
    share_cores(env, jobs)
    numbers = itertools.count()
    live: list = []
    state = {"stop": False}

    def stop(i, text):
        served.errors.append((i, text))
        state["stop"] = True

    def new_job():
        live.append(_Job(next(numbers), target, options, env, log_dir))

    def hand_out(job):
        while not state["stop"] and pending:
            i = pending[0]
            what = task(i)
            if what is None:
                state["stop"] = True
                break
            pending.popleft()
            if not job.send((i, what)):
                pending.appendleft(i)    # it died: its end of file is read next
                return
            job.running = i
            if started:
                started(i)
            return
        job.close_request()

    def ended(job):
        live.remove(job)
        tail = job.tail()
        code = job.end()
        how = _describe_exit(code) if code is not None else "ended"
        i, job.running = job.running, None
        if i is not None:
            served.deaths += 1
            if i in retried or state["stop"]:
                stop(i, f"a job {how} running it" + (" twice (a fresh job took it over once)" if i in retried else "")
                     + f"; the job's output ends:\n{tail}")
            else:
                retried.add(i)
                pending.appendleft(i)
                new_job()
        elif not job.closing and not state["stop"] and not live:    # the last job died while starting
            stop(None, f"a job {how} before its first run; its output ends:\n{tail}")

    try:
        for _ in range(min(jobs, count)):
            new_job()
        while live:
            ready = select.select([j.recv_fd for j in live], [], [])[0]
            for job in [j for j in live if j.recv_fd in ready]:
                try:
                    kind, i, value = _read_msg(job.recv_fd, None)
                except (EOFError, OSError):
                    ended(job)
                    continue
                if kind == "ready":
                    hand_out(job)
                elif kind == "done":
                    job.running = None
                    finished(i, *value)
                    hand_out(job)
                elif kind == "error":
                    job.running = None
                    stop(i, value)
                    job.close_request()
                elif kind == "fatal":
                    job.closing = True
                    if not served.errors:
                        stop(None, f"a job could not start: {value}")
                elif kind == "closed":
                    served.stats.append(value)
        if pending and not state["stop"]:      # never silently lost
            stop(None, f"every job ended with {len(pending)} runs not handed out")
    except KeyboardInterrupt:
        served.interrupted = True
        _interrupt(live, served, finished)
    finally:
        served.not_handed = sorted(pending)
        served.in_flight = sorted(set(served.in_flight) | {j.running for j in live if j.running is not None})
        for job in live:
            job.end(kill=True)
        shutil.rmtree(log_dir, ignore_errors=True)
    return served


def _interrupt(live: list, served: Served, finished) -> None:
    """Ctrl-C: every job interrupted (it stops its worker and exits); a result that comes meanwhile is kept. Jobs
    still there after GRACE_S, or at a second Ctrl-C, are killed (by the caller's `end(kill=True)`)."""
    for job in live:
        job.interrupt()
    deadline = time.monotonic() + GRACE_S
    try:
        while live and time.monotonic() < deadline:
            ready = select.select([j.recv_fd for j in live], [], [], max(0.0, deadline - time.monotonic()))[0]
            for job in [j for j in live if j.recv_fd in ready]:
                try:
                    kind, i, value = _read_msg(job.recv_fd, time.monotonic() + 5)
                except (EOFError, OSError, TimeoutError):
                    live.remove(job)
                    if job.running is not None:
                        served.in_flight.append(job.running)
                    job.end(kill=True)
                    continue
                if kind == "done":
                    job.running = None
                    finished(i, *value)
                elif kind == "closed":
                    served.stats.append(value)
    except KeyboardInterrupt:
        pass


def _job_main(fd_in: int, fd_out: int) -> None:
    """A job process (forked by the fork server): build the runner, then run what the parent sends until None."""
    import faulthandler
    faulthandler.enable()       # a crash (an --in-process backend's) prints the Python stack into the job's log
    try:
        target, options = _read_msg(fd_in, None)
        mod, fn = target.split(":")
        runner = getattr(importlib.import_module(mod), fn)(options)
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops handing out
        _write_msg(fd_out, ("fatal", None, traceback.format_exc()))
        return
    stats = None
    try:
        _write_msg(fd_out, ("ready", None, None))
        while True:
            msg = _read_msg(fd_in, None)
            if msg is None:
                break
            i, what = msg
            t0 = time.monotonic()
            try:
                result = runner.run(what)
                _write_msg(fd_out, ("done", i, (result, time.monotonic() - t0)))
            except OSError:
                raise
            except Exception:  # noqa: BLE001 - a bug of ours (or a result that does not pickle): the parent's to report
                _write_msg(fd_out, ("error", i, traceback.format_exc()))
    except (KeyboardInterrupt, EOFError, OSError):
        pass
    finally:
        try:
            stats = runner.close()
        except BaseException:  # noqa: BLE001 - closing after a Ctrl-C: nothing left to report
            pass
        try:
            _write_msg(fd_out, ("closed", None, stats))
        except (OSError, KeyboardInterrupt):
            pass
