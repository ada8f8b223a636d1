"""A fork server: a process that has imported torch and the harness forks the processes the harness starts
(supervised workers, EP ranks), so a start costs milliseconds instead of a new Python importing torch (about
2 CPU-seconds on a CPU machine; a backend that crashes or hangs costs one start per case).

One server per working directory and environment (less the variables only read at run time, RUNTIME_ONLY,
which each child gets as asked), started on first use and kept for the life of the process that asked: a
child is then what `python -c` with that environment in that directory would be, except that its modules
come already imported. The server never touches CUDA (it refuses to serve if an import did), so a child may
use the GPU. The server is each child's parent and reports its exit status; `start` returns a Popen-like
handle. A child does not outlive the process that asked for it: when that process ends (a worker killed in
the middle of an EP case, say), the server kills the children still running, with their process groups.
Where fork is not available, or the server cannot start, `start` runs the target in a new Python.

  python -m moe_lora_harness.harness.execution.fork_server FD   # started by start(), never by hand
"""
from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback

START_TIMEOUT = 180.0      # seconds for a server to import what it preloads
# environment variables read only at run time (pytest's per-test ones, the harness's own): a child gets its own
# values, so they need no server of their own
RUNTIME_ONLY = ("PYTEST_", "MOE_LORA_HARNESS_")
# what a server imports before it forks: torch, the worker's and EP ranks' side of the harness, and our builtin
# backends (Triton and our kernels: 0.3 CPU-s that every EP rank of ours would import again)
PRELOAD = ("torch", "torch.distributed", "moe_lora_harness.harness.execution.worker", "moe_lora_harness.harness.execution.execute",
           "moe_lora_harness.harness.spec.registry", "moe_lora_harness.harness.execution.ep_ranks",
           "moe_lora_harness.harness.execution.communicator", "moe_lora_harness.backends")
_MAX_MSG = 1 << 20
_MAX_FDS = 8


def available() -> bool:
    """Whether this platform can fork and pass file descriptors over a Unix socket."""
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and hasattr(os, "waitid")


class Child:
    """A started process, as much of subprocess.Popen as the harness uses: pid, poll, wait, kill, returncode."""

    def __init__(self, pid: int, server: "_Server"):
        self.pid, self.returncode, self._server = pid, None, server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._server.returncode(self.pid, block=True, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)   # not yet reaped: the pid is still this child's
            except ProcessLookupError:
                pass


class _Server:
    """The client side of one fork server: requests over a Unix socket, exit statuses read by a thread."""

    def __init__(self, env: dict, cwd: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen([sys.executable, "-m", "moe_lora_harness.harness.execution.fork_server",
                                      str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.lock = threading.Lock()               # one request at a time
        self.cond = threading.Condition()
        self.replies: dict = {}
        self.exits: dict = {}                      # pid -> returncode, reported and not yet reaped
        self.next_id = 0
        self.children: set = set()                 # started and not yet reaped
        ours.settimeout(START_TIMEOUT)
        self.alive = self._recv() == ("ready",)
        ours.settimeout(None)
        if self.alive:
            threading.Thread(target=self._read, daemon=True).start()
        else:
            self.close()

    def _recv(self):
        try:
            data = self.sock.recv(_MAX_MSG)
        except OSError:
            return None
        return pickle.loads(data) if data else None

    def _read(self) -> None:
        while True:
            msg = self._recv()
            with self.cond:
                if msg is None:
                    self.alive = False
                elif msg[0] == "exit":
                    self.exits[msg[1]] = msg[2]
                else:
                    self.replies[msg[1]] = msg
                self.cond.notify_all()
            if msg is None:
                return

    def _request(self, op: str, payload, fds=()):
        with self.lock:
            self.next_id += 1
            rid = self.next_id
            socket.send_fds(self.sock, [pickle.dumps((op, rid, payload))], list(fds))
        with self.cond:
            self.cond.wait_for(lambda: rid in self.replies or not self.alive)
            if rid not in self.replies:
                raise OSError("the fork server ended")
            return self.replies.pop(rid)

    def spawn(self, target: str, args: tuple, env: dict, fds: tuple) -> Child:
        reply = self._request("spawn", (target, args, env), fds)
        if reply[0] != "spawned":
            raise OSError(f"the fork server could not start {target}: {reply[2]}")
        self.children.add(reply[2])
        return Child(reply[2], self)

    def returncode(self, pid: int, block: bool, timeout: float | None = None) -> int | None:
        with self.cond:
            if block:
                self.cond.wait_for(lambda: pid in self.exits or not self.alive, timeout)
            if pid not in self.exits:
                if self.alive or not block:
                    return None
                return -signal.SIGKILL   # the server died (killed with its caller): the child's status is lost
            code = self.exits.pop(pid)
        try:
            self._request("reap", pid)   # the pid is released only now (as Popen.wait releases it)
        except OSError:
            pass
        self.children.discard(pid)
        return code

    def close(self) -> None:
        self.alive = False
        try:
            self.sock.close()             # the server ends at end of file
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict = {}
_SERVERS_LOCK = threading.Lock()
_KEEP = 2     # servers kept at once (a third environment closes the least recently used)


def _server_for(env: dict, cwd: str) -> _Server | None:
    key = (cwd, tuple(sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_ONLY))))
    with _SERVERS_LOCK:
        server = _SERVERS.pop(key, None)
        if server is None or not server.alive:
            try:
                server = _Server(env, cwd)
            except OSError:
                server = None
        _SERVERS[key] = server      # most recent last; a failed start is remembered (plain starts from then on)
        idle = [k for k, s in _SERVERS.items() if k != key and (s is None or not s.children)]
        for k in idle[:max(0, len(_SERVERS) - _KEEP)]:     # a server with live children keeps them reported
            old = _SERVERS.pop(k)
            if old is not None:
                old.close()
    return server if server is not None and server.alive else None


def start(target: str, args: tuple = (), *, env: dict, pass_fds: tuple = (), output: int | None = None,
          cwd: str | None = None):
    """Start `target` ("module:function") as a process of its own session: function(*args, *fds), `args` plain
    values (ints, strings), `fds` the numbers the descriptors `pass_fds` have in the child, in order; stdout
    and stderr on the descriptor `output` (default: discarded), stdin empty. The child exits 0 when the
    function returns, with a SystemExit's code, or 1 after printing an exception. Returns a Popen-like handle."""
    cwd = cwd or os.getcwd()
    server = _server_for(env, cwd) if available() else None
    if server is not None:
        out = output if output is not None else os.open(os.devnull, os.O_WRONLY)
        try:
            return server.spawn(target, tuple(args), dict(env), (out, *pass_fds))
        except OSError:
            pass     # the server ended meanwhile: a plain start
        finally:
            if output is None:
                os.close(out)
    mod, fn = target.split(":")
    code = (f"import os, sys; from {mod} import {fn}; {fn}(*{tuple(args)!r}, *{tuple(pass_fds)!r}); "
            f"sys.stdout.flush(); sys.stderr.flush(); os._exit(0)")
    sink = subprocess.DEVNULL if output is None else output
    return subprocess.Popen([sys.executable, "-c", code], pass_fds=tuple(pass_fds), env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def start_talking(target: str, *, env: dict, output: int):
    """`start` a target that takes two descriptors, its end of a pipe to it and one from it: (handle, the fd to write
    to it, the fd to read from it); the child's ends and `output` are closed here once it has them."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    try:
        proc = start(target, env=env, pass_fds=(to_r, from_w), output=output)
    except BaseException:
        os.close(to_w)
        os.close(from_r)
        raise
    finally:
        for fd in (to_r, from_w, output):
            os.close(fd)
    return proc, to_w, from_r


# -- the server process ------------------------------------------------------------------------------------------

def _send(sock: socket.socket, msg) -> None:
    sock.send(pickle.dumps(msg))


def _child(sock, wake_fds, ready_w: int, target: str, args: tuple, env: dict, fds: list) -> None:
    """In the forked child: its own session, environment and descriptors, then the target; never returns."""
    code = 1
    try:
        os.setsid()
        os.close(ready_w)                # the server may now report the child started (its group exists)
        sock.close()
        for fd in wake_fds:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[0], 2)
        for fd in {null, fds[0]} - {0, 1, 2}:
            os.close(fd)
        mod, fn = target.split(":")
        getattr(importlib.import_module(mod), fn)(*args, *fds[1:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's own failure: printed, exit 1
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _returncode(info) -> int:
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)     # wakes select when a child ends
    live: set = set()       # started, exit not yet reported
    ended: set = set()      # exit reported, not yet reaped (the pid stays the child's until the client reaps)
    while True:
        ready = select.select([sock, wake_r], [], [], 1.0)[0]
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        for pid in list(live):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                live.discard(pid)
                ended.add(pid)
                _send(sock, ("exit", pid, _returncode(info)))
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, _MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:        # the client closed its end or ended (e.g. a worker killed mid-case): so do its children
            for pid in live:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            return
        op, rid, payload = pickle.loads(data)
        if op == "reap":
            if payload in ended:
                os.waitpid(payload, 0)
                ended.discard(payload)
            _send(sock, ("reaped", rid))
            continue
        target, args, env = payload
        ready_r, ready_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            pid, error = -1, f"{type(e).__name__}: {e}"
        if pid == 0:
            os.close(ready_r)
            _child(sock, (wake_r, wake_w), ready_w, target, args, env, fds)
        os.close(ready_w)
        if pid > 0:
            os.read(ready_r, 1)      # end of file once the child has its own session
            live.add(pid)
        os.close(ready_r)
        for fd in fds:
            os.close(fd)
        _send(sock, ("spawned", rid, pid) if pid > 0 else ("error", rid, error))


def _server_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C is the harness's to handle
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        import torch
        if torch.cuda.is_initialized():   # a forked child could not use the GPU
            raise RuntimeError("CUDA was initialized while preloading")
    except BaseException as e:  # noqa: BLE001 - reported as not ready: the client starts processes plainly
        _send(sock, ("failed", f"{type(e).__name__}: {e}"))
        return
    _send(sock, ("ready",))
    _serve(sock)


if __name__ == "__main__":
    _server_main(int(sys.argv[1]))
    os._exit(0)
