"""The backend side of a run: build a case's inputs on the device, call the backend, watch its inputs.

`execute` runs wherever the backend runs: in the supervised worker process (harness/execution/worker.py), or in
the caller's process (`InProcess`). The inputs are drawn where the judge draws its own (harness.build.builders.draw_device:
the run's device, the CPU for a small case, copied to the run's device after the digest). It returns an `Execution` of plain CPU data, which the judge
(harness/execution/runner.py) compares with the float64 reference it computed on its own. The judge checks that
the inputs the backend saw are the ones it judged (`built_digest`), and every input tensor handed to
the backend is compared bit for bit before and after the call (`inputs_written`). Every tensor of a call (op
level; expert level, each EP or TP rank's call too) is handed over between poisoned guard bands
(harness.build.guards: a read past an end brings NaN in, a write past one is reported, `outside_written`); the
layer level's in harness/execution/layer_execute.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import time
import traceback
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.build.builders import build_expert_inputs, build_op_inputs, draw_device
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.harness.build.guards import (SNAPSHOT_MAX_BYTES, ReportedBands, bits_dtype, guard_calls,
                                                   guard_fields, written_outside)
from moe_lora_harness.harness.execution.interpreter import LaunchWatch

# An error after which the device context cannot be trusted: the worker is restarted.
_FATAL_DEVICE_ERROR = re.compile(r"CUDA error|illegal memory access|device-side assert|unspecified launch failure"
                                 r"|CUBLAS_STATUS|cudaError", re.I)


def raised_text(e: BaseException) -> str:
    """What a backend's exception says: its message, then its notes in brackets (e.g. "raised on EP rank 1 of 2",
    communicator.add_note)."""
    notes = getattr(e, "__notes__", None)
    return f"{e}" + (" [" + "; ".join(str(n) for n in notes) + "]" if notes else "")


class ExecutionFailure(Exception):
    """Raised by a driver of the harness with the Failure it already classified (e.g. an EP rank's crash)."""

    def __init__(self, failure: "Failure"):
        super().__init__(failure.message)
        self.failure = failure


NO_MEMORY = "no-memory"    # a Failure's kind: the harness's own input building ran out of device memory


def harness_built(build):
    """`build()`: the harness's own work before the backend is called (drawing the case's inputs). Out of device memory
    there is the machine's limit, not the backend's failure: raised as ExecutionFailure(kind NO_MEMORY), which the
    runner reports not runnable (the case's memory estimate fell short: harness.build.case_memory)."""
    try:
        return build()
    except torch.OutOfMemoryError as e:
        raise ExecutionFailure(Failure(NO_MEMORY, f"the harness ran out of device memory drawing the case's inputs, "
                                       f"before the backend was called: {str(e).splitlines()[0][:300]}",
                                       type(e).__name__)) from e


class HarnessInterrupt(BaseException):
    """Raised by the harness itself into a running backend (a test's timeout): never the backend's failure."""


@dataclass
class Failure:
    """Why a backend call produced no judged output: raised, crash, timeout, load (its reference), worker, no-memory
    (the harness's own input drawing: NO_MEMORY)."""

    kind: str
    message: str
    exc_type: str = ""
    traceback: str = ""
    fatal: bool = False        # the worker must be restarted after it

    @property
    def signature(self) -> str:
        return f"{self.kind}:{self.exc_type}" if self.exc_type else self.kind


@dataclass
class Execution:
    """What one backend call produced, as the judge needs it: CPU tensors and strings only (picklable)."""

    output: torch.Tensor | None = None
    failure: Failure | None = None
    built_digest: str = ""                                 # of the CPU inputs, as built, before any move
    inputs_written: list = field(default_factory=list)     # names of input tensors the backend changed
    outside_written: list = field(default_factory=list)    # where it wrote outside its tensors (guards.Bands)
    seconds: float = 0.0
    log: str = ""                                          # the worker's output during the call (tail)
    launches: list = field(default_factory=list)           # (kernel, tensor dtypes) run in Triton's interpreter


def _tensors(obj, prefix: str = ""):
    """(name, tensor) for every tensor reachable from a dataclass / list / dict, in a stable order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _tensors(obj[k], f"{prefix}.{k}" if prefix else k)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(bits_dtype(t.dtype)) if t.is_floating_point() else t


def inputs_digest(built) -> str:
    """A digest of every tensor of a built inputs record (names, shapes, dtypes, bytes): same digest, same inputs.
    On the CPU the sha1 of the bytes; a record with a tensor on another device is digested where it lies
    (harness.judge.tensor_digest: no copy of its bytes to the host)."""
    named = [(name, t) for name, t in _tensors(built) if name != "case"]
    if any(t.device.type != "cpu" for _, t in named):
        from moe_lora_harness.harness.judge.tensor_digest import digest
        return "device:" + digest(named)
    h = hashlib.sha1()
    for name, t in named:
        c = _raw(t.cpu())
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        flat = c.numpy().reshape(-1)
        if flat.size:
            h.update(memoryview(flat).cast("B"))   # the bytes in place, not copied
    return h.hexdigest()


class InputWatch:
    """Snapshots of the tensors handed to a backend, compared bit for bit after the call; a tensor over
    SNAPSHOT_MAX_BYTES is snapshotted as its digest (`inputs_digest`: sha1 in place on the CPU, 0.4 s a GiB; the lane
    sums where it lies on a device), not copied."""

    def __init__(self):
        self._snaps: list = []
        self.extra_written: list = []    # names reported written by another process (EP rank processes)

    def add(self, name: str, obj, skip=("output",)):
        for sub, t in _tensors(obj, name):
            if sub.rsplit(".", 1)[-1] in skip:
                continue
            digested = t.numel() * t.element_size() > SNAPSHOT_MAX_BYTES
            self._snaps.append((sub, t, digested, inputs_digest(t) if digested else _raw(t).clone()))

    def written(self) -> list[str]:
        return [name for name, t, digested, snap in self._snaps
                if (inputs_digest(t) != snap if digested else not torch.equal(_raw(t), snap))] + self.extra_written


def _sync(device: str):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def release_device_memory(device) -> None:
    """Hand the cached blocks of a CUDA device back to the driver (the judge and the worker share one GPU: what
    one process's allocator keeps after a case, the other cannot use)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _run_op(spec: BackendSpec, case: Case, device: str, poison, watch: InputWatch, bands: list):
    at = draw_device(case, device)
    inp = harness_built(lambda: build_op_inputs(case, at))     # drawn where the judge draws them
    digest = inputs_digest(inp)
    if at.type != torch.device(device).type:    # drawn on the CPU for another device (a small CUDA case): moved there
        inp = inp.to(device)
    if poison is not None:   # elements the contract neither reads nor must keep: NaN, so a missed write shows
        inp.output[poison.to(inp.output.device)] = float("nan")
    (kw,), guarded = guard_fields([inp.call_kwargs()], [""])
    bands.extend(guarded)
    watch.add("", {k: v for k, v in kw.items() if k != "output"})
    spec.op(**kw)
    _sync(device)
    return digest, kw["output"]


def run_expert_inputs(spec: BackendSpec, built, case: Case, device: str, watch: InputWatch | None = None,
                      bands: list | None = None) -> torch.Tensor:
    """The backend on an expert-level case's inputs `built`, in this process, as a run calls it: every simulated
    dispatched-EP rank, every TP rank (recombined), or the calls of one rank. `watch` snapshots the inputs each call
    gets; with `bands` (a list) each call's tensors are handed over between guard bands kept there."""
    from moe_lora_harness.harness.build.expert_runner import run_calls, run_tp_ranks
    if case.dispatched:
        from moe_lora_harness.harness.execution.ep_ranks import run_simulated
        return run_simulated(spec, built, case, device, watch, bands)
    if case.tp_size > 1:
        return run_tp_ranks(spec, built, case, device, watch, bands)
    call = built.call(device)
    if bands is not None:
        (call,), guarded = guard_calls([call], [""])
        bands.extend(guarded)
    if watch is not None:
        watch.add("", call)
    return run_calls(spec, call, case)


def _run_expert(spec: BackendSpec, case: Case, device: str, watch: InputWatch, launches: LaunchWatch, bands: list):
    built = harness_built(lambda: build_expert_inputs(case, draw_device(case, device)))  # where the judge draws
    digest = inputs_digest(built)
    if case.dispatched and case.ep_comm == "processes":
        from moe_lora_harness.harness.execution import ep_ranks
        output, written, digest, remote, outside = ep_ranks.run_processes(spec, case, device, digest)
        watch.extra_written.extend(written)
        bands.append(ReportedBands(outside))
        launches.launches.extend(remote)     # the ranks' interpreted kernels count as this call's
    else:
        output = run_expert_inputs(spec, built, case, device, watch, bands)
    _sync(device)
    return digest, output


_SETUP_DONE: dict = {}   # setup identity -> None (done) or the Failure it raised, once per process


def _setup_key(setup):
    return setup if isinstance(setup, str) else id(setup)


def run_setup(spec: BackendSpec) -> Failure | None:
    """Run the backend's declared setup once in this process; its failure is an environment failure (kept, so
    every later case of the backend reports it without running again)."""
    setup = spec.setup
    if setup is None:
        return None
    key = _setup_key(setup)
    if key in _SETUP_DONE:
        return _SETUP_DONE[key]
    failure = None
    try:
        fn = setup
        if isinstance(setup, str):
            from moe_lora_harness.harness.spec.registry import load_attr
            fn = load_attr(setup)
        fn()
    except BaseException as e:  # noqa: BLE001 - a setup that fails is the environment's failure
        if isinstance(e, HarnessInterrupt):
            raise
        failure = Failure("environment", f"the backend's setup ({setup if isinstance(setup, str) else getattr(setup, '__name__', setup)}) "
                                         f"raised {type(e).__name__}: {e}"[:4000], type(e).__name__,
                          "".join(traceback.format_exception(e)[-6:])[-6000:])
    _SETUP_DONE[key] = failure
    return failure


def execute(spec: BackendSpec, case: Case, device: str, poison=None, *, catch_interrupt: bool = True) -> Execution:
    """Run `spec` on `case` once; any exception of the backend (SystemExit too) becomes a `Failure`.

    `poison`: for op cases, the output elements to set to NaN first (those the contract does not read).
    With `catch_interrupt=False` a KeyboardInterrupt propagates (in-process runs: it may be the user's Ctrl-C).
    """
    watch = InputWatch()
    t0 = time.perf_counter()
    digest, out, failure = "", None, None
    setup_failure = run_setup(spec)
    if setup_failure is not None:
        return Execution(failure=setup_failure, seconds=time.perf_counter() - t0)
    launches = LaunchWatch()
    bands: list = []
    try:
        with launches:
            if case.level == "op":
                digest, out = _run_op(spec, case, device, poison, watch, bands)
            else:
                digest, out = _run_expert(spec, case, device, watch, launches, bands)
    except ExecutionFailure as e:   # a driver's own classification (an EP rank that died, hung or raised)
        failure = e.failure
    except BaseException as e:  # noqa: BLE001 - whatever a backend raises is its failure, never our exit
        if isinstance(e, HarnessInterrupt) or (isinstance(e, KeyboardInterrupt) and not catch_interrupt):
            raise
        msg = raised_text(e)
        failure = Failure("raised", msg[:4000], type(e).__name__,
                          "".join(traceback.format_exception(e)[-6:])[-6000:],
                          fatal=bool(_FATAL_DEVICE_ERROR.search(msg)) or bool(getattr(e, "harness_fatal", False)))
    seconds = time.perf_counter() - t0
    written = watch.written() if failure is None else []
    outside = written_outside(bands) if failure is None else []
    cpu_out = out.detach().cpu().clone() if (out is not None and failure is None) else None
    del out, watch, bands
    if failure is None or not failure.fatal:   # after a fatal device error the context is not touched again
        release_device_memory(device)
    return Execution(cpu_out, failure, digest, written, outside, seconds, launches=launches.launches)


class InProcess:
    """Runs backends in the calling process (fast; a backend that crashes or hangs takes the caller with it)."""

    supervised = False

    def execute(self, spec: BackendSpec, case: Case, device: str, poison=None) -> Execution:
        return execute(spec, case, device, poison, catch_interrupt=False)

    def execute_scenario(self, spec: BackendSpec, scenario, device: str, start: int = 0):
        """Steps `start:` of a layer scenario (harness.execution.layer_execute)."""
        from moe_lora_harness.harness.execution.layer_execute import execute_scenario
        return execute_scenario(spec, scenario, device, start)

    def close(self):
        pass
