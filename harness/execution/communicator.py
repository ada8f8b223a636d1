"""The collectives an expert-parallel backend is handed (`ExpertCall.ep_comm`), behind one small interface.

This is part of the backend contract: a dispatched-EP backend gets a `Communicator` for its rank and does its
own dispatch and combine through it (our kernels' NaiveEPPrepareAndFinalize takes any object with this
interface).

`all_gather(tensors)` concatenates each tensor along dim 0 over the ranks, in rank order, with uneven
first dims allowed (the sizes are exchanged first); `reduce_scatter(t, sizes)` sums the ranks' `t`
(rows = sum(sizes)) in fp32 (float64 stays float64), rounds once to t.dtype and returns this rank's rows.

Two implementations: `TorchDistributedCommunicator` (torch.distributed, default or given group; gloo
works: the all-gather pads to the largest rank and trims) and `SimulatedGroup(size)`, whose
`rank_communicator(r)` objects are used by `size` Python threads (`SimulatedGroup.run`); a rank that skips
(or mismatches) a collective makes the others raise after `timeout_s`, naming the rank and the collective.
The threads take turns (one runs at a time, switching only inside a collective): the Triton interpreter and
much other code are not thread-safe, and turn-taking keeps a simulated run deterministic.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["Communicator", "TorchDistributedCommunicator", "SimulatedGroup", "SimulatedCommunicator",
           "CollectiveError", "RankHung"]


def add_note(e: BaseException, note: str) -> None:
    """PEP 678's note on `e` (its `__notes__`, which the runner appends to a failure's message), on Python 3.10
    too, whose exceptions have no add_note."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        e.__notes__ = [*getattr(e, "__notes__", ()), note]


class CollectiveError(RuntimeError):
    """A collective could not complete (a rank skipped it, called another one, or failed)."""


class RankHung(CollectiveError):
    """A simulated rank never returned; its thread cannot be stopped, so the process must be replaced."""

    harness_fatal = True


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation for 16-bit and fp32 tensors, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _check_sizes(t: torch.Tensor, sizes, size: int, rank: int) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise ValueError(f"reduce_scatter (rank {rank}): t must be a tensor with a row dim; got {type(t).__name__}")
    sizes = [int(s) for s in sizes]
    if len(sizes) != size or any(s < 0 for s in sizes) or sum(sizes) != t.shape[0]:
        raise ValueError(f"reduce_scatter (rank {rank}): sizes must be {size} non-negative row counts summing to "
                         f"t.shape[0]={t.shape[0]}; got {sizes}")
    return sizes


class Communicator:
    """One rank's view of a group: `rank`, `size`, `all_gather`, `reduce_scatter` (see the module doc)."""

    rank: int
    size: int

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor concatenated along dim 0 over the ranks (rank order); first dims may differ by rank."""
        raise NotImplementedError

    def reduce_scatter(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Sum of every rank's t (fp32 accumulate, one rounding to t.dtype); this rank's rows of it."""
        raise NotImplementedError


# ----------------------------------------------------------------------------- torch.distributed


class TorchDistributedCommunicator(Communicator):
    """Collectives over torch.distributed (the default group, or `group`); works on gloo and NCCL."""

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistributedCommunicator needs torch.distributed initialized "
                               "(init_process_group) first")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _gather_sizes(self, n: int, device) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        parts = [torch.zeros_like(mine) for _ in range(self.size)]
        self._dist.all_gather(parts, mine, group=self.group)
        return [int(p.item()) for p in parts]

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"all_gather (rank {self.rank}): tensors[{i}] must be a tensor with a row dim")
            t = t.contiguous()
            sizes = self._gather_sizes(int(t.shape[0]), t.device)
            m = max(sizes)
            padded = torch.zeros((m, *t.shape[1:]), dtype=t.dtype, device=t.device)
            padded[:t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            self._dist.all_gather(parts, padded, group=self.group)
            out.append(torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0))
        return out

    def reduce_scatter(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        sizes = _check_sizes(t, sizes, self.size, self.rank)
        acc = t.to(_acc_dtype(t.dtype)).contiguous()
        # all_reduce then slice: gloo has no reduce_scatter with uneven sizes; the sum is the same
        self._dist.all_reduce(acc, op=self._dist.ReduceOp.SUM, group=self.group)
        lo = sum(sizes[:self.rank])
        return acc[lo:lo + sizes[self.rank]].to(t.dtype)


# ----------------------------------------------------------------------------- simulated (threads)


class SimulatedGroup:
    """`size` ranks as threads of one process; `rank_communicator(r)` is rank r's Communicator.

    Every collective is a deposit-wait-read-wait exchange on a threading.Barrier with `timeout_s`; a rank
    that never arrives breaks the barrier and the waiting ranks raise CollectiveError naming themselves,
    the collective and the ranks that did not arrive. Ranks calling different collectives also raise.
    The partial sums of reduce_scatter are added in rank order in fp32 (float64 stays float64).
    """

    def __init__(self, size: int, timeout_s: float = 30.0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"SimulatedGroup size must be an int >= 1; got {size!r}")
        self.size = size
        self.timeout_s = float(timeout_s)
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size
        self._names: list = [None] * size
        self._turn = threading.Lock()          # held by the one rank that runs (SimulatedGroup.run)
        self._turn_holder: int | None = None

    def run(self, fn, join_timeout_s: float | None = None) -> list:
        """fn(rank_communicator(r)) for every rank, each in its own thread, taking turns; results in rank order.

        The first error that is not a CollectiveError (the root cause) is re-raised, with a note naming its
        rank; the group is aborted so no other rank waits for the failed one. A rank still running after
        `join_timeout_s` raises RankHung.
        """
        results, errors = [None] * self.size, [None] * self.size

        def body(r):
            self._turn.acquire()
            self._turn_holder = r
            try:
                results[r] = fn(self.rank_communicator(r))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors[r] = e
                self.abort()
            finally:
                self._turn_holder = None
                self._turn.release()

        threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"ep-rank-{r}")
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_timeout_s)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            self.abort()
            raise RankHung(f"simulated EP rank(s) {hung} did not return within {join_timeout_s:g}s")
        first = next((r for r, e in enumerate(errors) if e is not None and not isinstance(e, CollectiveError)), None)
        if first is None:
            first = next((r for r, e in enumerate(errors) if e is not None), None)
        if first is not None:
            e = errors[first]
            add_note(e, f"raised on EP rank {first} of {self.size}")
            raise e
        return results

    def rank_communicator(self, rank: int) -> "SimulatedCommunicator":
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"rank must be an int in [0, size={self.size}); got {rank!r}")
        return SimulatedCommunicator(self, rank)

    def abort(self) -> None:
        """Release every rank waiting in a collective (they raise CollectiveError)."""
        self._barrier.abort()

    def _wait(self, rank: int, name: str) -> None:
        mine = self._turn_holder == rank and self._turn.locked()
        if mine:                   # give the turn to another rank while this one waits
            self._turn_holder = None
            self._turn.release()
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            if mine:
                self._turn.acquire()
                self._turn_holder = rank
            missing = [r for r in range(self.size) if self._names[r] != name]
            raise CollectiveError(
                f"rank {rank}: collective {name} did not complete within {self.timeout_s:g}s: rank(s) "
                f"{missing} never joined it (skipped it, called another collective, or failed)") from None
        if mine:
            self._turn.acquire()
            self._turn_holder = rank

    def exchange(self, rank: int, name: str, value):
        """Deposit rank's value under `name`, wait for every rank, return all values in rank order."""
        self._slots[rank] = value
        self._names[rank] = name
        self._wait(rank, name)
        names, values = list(self._names), list(self._slots)
        self._wait(rank, name)   # everyone has read the slots before anyone overwrites them
        if any(n != name for n in names):
            self._names[rank] = None
            raise CollectiveError(f"rank {rank}: collective {name} met mismatched collectives "
                                  f"{ {r: n for r, n in enumerate(names)} }")
        self._names[rank] = None
        return values


class SimulatedCommunicator(Communicator):
    """Rank `rank` of a SimulatedGroup."""

    def __init__(self, group: SimulatedGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"all_gather (rank {self.rank}): tensors[{i}] must be a tensor with a row dim")
        parts = self.group.exchange(self.rank, f"all_gather[{len(tensors)}]", [t.detach().clone() for t in tensors])
        return [torch.cat([p[i].to(tensors[i].device) for p in parts], dim=0) for i in range(len(tensors))]

    def reduce_scatter(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        sizes = _check_sizes(t, sizes, self.size, self.rank)
        parts = self.group.exchange(self.rank, "reduce_scatter", t.detach().clone())
        acc = _acc_dtype(t.dtype)
        total = parts[0].to(acc).clone()
        for p in parts[1:]:
            if p.shape != t.shape:
                raise CollectiveError(f"reduce_scatter (rank {self.rank}): ranks passed shapes "
                                      f"{[tuple(q.shape) for q in parts]}; they must agree")
            total += p.to(acc).to(t.device)
        lo = sum(sizes[:self.rank])
        return total[lo:lo + sizes[self.rank]].to(t.dtype)
