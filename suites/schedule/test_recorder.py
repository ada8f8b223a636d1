"""The CPU race detector (kernels.schedule.Recorder): happens-before by vector clocks, event misuse,
and a property test against a brute-force happens-before (transitive closure of the same edges)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_lora_harness.harness.draw.strategies import suite_settings
from moe_lora_harness.kernels.schedule import MAIN, Recorder, ScheduleError, named
from moe_lora_harness.kernels.schedule.interface import buffer_ref, tensor_span


def two_streams(**kw):
    r = Recorder(**kw)
    r.stream("a"), r.stream("b")
    return r


def test_program_order_within_a_stream_is_not_a_race():
    r = two_streams()
    x = torch.randn(8)
    r.launch("w1", "a", None, writes=[("x", x)])
    r.launch("r1", "a", None, reads=[("x", x)])
    r.launch("w2", "a", None, writes=[("x", x)])
    assert r.clean, r.problems


def test_unordered_write_then_read_is_reported_with_both_ops_streams_and_buffer():
    r = two_streams()
    x = torch.randn(8)
    r.launch("producer", "a", None, writes=[("x", x)])
    r.launch("consumer", "b", None, reads=[("x", x)])
    assert len(r.races) == 1
    race = r.races[0]
    assert (race.first.name, race.first.stream, race.second.name, race.second.stream) == ("producer", "a", "consumer", "b")
    assert race.buffer == "x" and race.kind == "write/read" and race.span == (0, 32)
    text = str(race)
    for word in ("producer", "consumer", "stream a", "stream b", "x"):
        assert word in text
    with pytest.raises(ScheduleError, match="producer"):
        r.assert_clean()


def test_record_wait_orders_across_streams():
    r = two_streams()
    r.event("e")
    x = torch.randn(8)
    r.launch("producer", "a", None, writes=[("x", x)])
    r.record("e", "a")
    r.wait("e", "b")
    r.launch("consumer", "b", None, reads=[("x", x)])
    r.launch("overwrite", "b", None, writes=[("x", x)])
    assert r.clean, r.problems


def test_reads_never_race_and_disjoint_bytes_never_race():
    r = two_streams()
    x = torch.randn(4, 8)
    r.launch("r_a", "a", None, reads=[("x", x)])
    r.launch("r_b", "b", None, reads=[("x", x)])
    r.launch("w_row0", "a", None, writes=[("x[0]", x[0])])
    r.launch("w_row1", "b", None, writes=[("x[1]", x[1])])
    assert [(a.first.name, a.second.name) for a in r.races] == [("r_b", "w_row0"), ("r_a", "w_row1")]
    r2 = two_streams()
    r2.launch("w_row0", "a", None, writes=[("x[0]", x[0])])
    r2.launch("w_row1", "b", None, writes=[("x[1]", x[1])])
    assert r2.clean
    r2.launch("w_rows01", "b", None, writes=[("x[:2]", x[:2])])  # overlaps row 0 written on a
    assert len(r2.races) == 1 and r2.races[0].kind == "write/write" and r2.races[0].span == (0, 32)


def test_buffers_by_name_and_tensor_spans():
    r = two_streams()
    r.launch("w", "a", None, writes=["align"])
    r.launch("r", "b", None, reads=["align"])
    assert [x.buffer for x in r.races] == ["align"]
    x = torch.randn(4, 6)
    assert tensor_span(x[1:3, 2:4]) == (4 * 8, 4 * (2 * 6 + 4))  # first element 8, last 15 -> bytes [32, 64)
    assert tensor_span(x[:0]) == (0, 0)
    assert buffer_ref(x).overlaps(named("y", x.view(-1)[5:6]))
    assert not named("a", x[0]).overlaps(named("b", torch.randn(4)))   # another allocation


def test_host_sync_orders_everything():
    r = two_streams()
    x = torch.randn(8)
    r.launch("w", "a", None, writes=[("x", x)])
    r.host_sync()
    r.launch("r", "b", None, reads=[("x", x)])
    assert r.clean


def test_happens_before_is_transitive_through_a_third_stream():
    r = two_streams()
    r.stream("c"), r.event("e1"), r.event("e2")
    x = torch.randn(8)
    r.launch("w", "a", None, writes=[("x", x)])
    r.record("e1", "a"); r.wait("e1", "b")
    r.launch("mid", "b", None, reads=["other"])
    r.record("e2", "b"); r.wait("e2", "c")
    r.launch("r", "c", None, reads=[("x", x)])
    assert r.clean, r.problems


def test_wait_on_never_recorded_event_is_reported_and_orders_nothing():
    r = two_streams()
    r.event("e")
    x = torch.randn(8)
    r.launch("w", "a", None, writes=[("x", x)])
    r.wait("e", "b")
    r.launch("r", "b", None, reads=[("x", x)])
    assert [h.kind for h in r.hazards] == ["wait-unrecorded"] and "never recorded" in str(r.hazards[0])
    assert len(r.races) == 1
    r.record("e", "a")   # recording later does not repair the earlier (no-op) wait


def test_event_recorded_before_the_kernel_it_should_follow_is_a_race():
    r = two_streams()
    r.event("done")
    x = torch.randn(8)
    r.record("done", "a")
    r.launch("producer", "a", None, writes=[("x", x)])
    r.wait("done", "b")
    r.launch("consumer", "b", None, reads=[("x", x)])
    assert len(r.races) == 1 and r.races[0].first.name == "producer"


def test_event_reuse_signs():
    # a record overwritten before anyone waited on it
    r = two_streams()
    r.event("e")
    r.record("e", "a"); r.record("e", "a")
    assert [h.kind for h in r.hazards] == ["event-reuse"] and "lost" in r.hazards[0].message
    # a stream waiting twice on the same record (its second wait meant a later record)
    r = two_streams()
    r.event("e")
    r.record("e", "a"); r.wait("e", "b"); r.wait("e", "b")
    assert len(r.hazards) == 1 and "waits again" in r.hazards[0].message
    # waiting on a record of one's own stream orders nothing
    r = two_streams()
    r.event("e")
    r.record("e", "a"); r.wait("e", "a")
    assert len(r.hazards) == 1 and "same stream" in r.hazards[0].message
    # re-recorded while a waiter of the older record is not ordered before the re-record
    r = two_streams()
    r.event("e")
    r.record("e", "a"); r.wait("e", "b"); r.record("e", "a")
    assert len(r.hazards) == 1 and "still depends on the older record" in r.hazards[0].message
    # ... but once the waiter's wait is ordered before the re-record, reuse (across calls) is fine
    r = two_streams()
    r.event("e"), r.event("back")
    r.record("e", "a"); r.wait("e", "b"); r.record("back", "b"); r.wait("back", "a"); r.record("e", "a")
    assert r.clean, r.problems


def test_execution_in_issue_order_and_dry_mode():
    r = two_streams()
    seen = []
    assert r.launch("one", "a", lambda: seen.append(1) or "ret") == "ret"
    r.launch("two", "b", lambda: seen.append(2))
    assert seen == [1, 2] and [op.name for op in r.ops] == ["one", "two"]
    dry = two_streams(execute=False)
    dry.launch("never", "a", lambda: seen.append(3))
    assert seen == [1, 2]


def test_bad_input_is_named():
    r = Recorder()
    with pytest.raises(ScheduleError, match="unknown stream 'aux'"):
        r.launch("k", "aux", None)
    with pytest.raises(ScheduleError, match="unknown event 'e'"):
        r.record("e", MAIN)
    with pytest.raises(TypeError, match="fn must be callable"):
        r.launch("k", MAIN, 3)
    with pytest.raises(TypeError, match="a buffer must be"):
        r.launch("k", MAIN, None, reads=[3.0])
    with pytest.raises(TypeError, match="must be a list of buffers"):
        r.launch("k", MAIN, None, reads=torch.zeros(1))
    with pytest.raises(TypeError, match="stream name"):
        r.stream("")
    r.stream("aux"), r.stream("aux"), r.event("e"), r.event("e")
    assert (r.created_streams, r.created_events) == (1, 1)


# ---------------------------------------------------------------- property: clocks == brute force

STREAMS, EVENTS, BUFS = ("main", "a", "b"), ("e0", "e1"), ("x", "y")

_launch = st.tuples(st.just("launch"), st.sampled_from(STREAMS), st.sampled_from(BUFS), st.booleans())
_record = st.tuples(st.just("record"), st.sampled_from(STREAMS), st.sampled_from(EVENTS), st.just(False))
_wait = st.tuples(st.just("wait"), st.sampled_from(STREAMS), st.sampled_from(EVENTS), st.just(False))
_sync = st.tuples(st.just("sync"), st.just("host"), st.just(""), st.just(False))
# a handoff (record on one stream, wait on another) makes cross-stream edges common in small programs
_handoff = st.tuples(st.sampled_from(STREAMS), st.sampled_from(STREAMS), st.sampled_from(EVENTS)).map(
    lambda t: [("record", t[0], t[2], False), ("wait", t[1], t[2], False)])
item_st = st.one_of(_launch.map(lambda o: [o]), _launch.map(lambda o: [o]), _handoff,
                    _record.map(lambda o: [o]), _wait.map(lambda o: [o]), _sync.map(lambda o: [o]))
program_st = st.lists(item_st, min_size=1, max_size=12).map(lambda items: [op for it in items for op in it])


def brute_force(prog):
    """(reach, racing pairs) from the explicit happens-before graph and its transitive closure."""
    n = len(prog)
    edge = [[False] * n for _ in range(n)]
    last_on, last_record = {}, {}
    for j, (kind, stream, name, _) in enumerate(prog):
        if kind == "sync":
            for i in range(j):
                edge[i][j] = True
            for k in range(j + 1, n):
                edge[j][k] = True
            continue
        if stream in last_on:
            edge[last_on[stream]][j] = True
        last_on[stream] = j
        if kind == "record":
            last_record[name] = j
        elif kind == "wait" and name in last_record:
            edge[last_record[name]][j] = True
    reach = [row[:] for row in edge]
    for k in range(n):
        for i in range(n):
            if reach[i][k]:
                for j in range(n):
                    if reach[k][j]:
                        reach[i][j] = True
    out = set()
    for j, (kj, _, bj, wj) in enumerate(prog):
        for i in range(j):
            ki, _, bi, wi = prog[i]
            if kj == ki == "launch" and bi == bj and (wi or wj) and not reach[i][j]:
                out.add((i, j))
    return reach, out


@suite_settings(max_examples=300)
@given(prog=program_st)
def test_vector_clocks_match_brute_force_happens_before(prog):
    r = Recorder()
    r.stream("a"), r.stream("b"), r.event("e0"), r.event("e1")
    for kind, stream, name, write in prog:
        if kind == "launch":
            r.launch(f"k{len(r.ops)}", stream, None, **({"writes": [name]} if write else {"reads": [name]}))
        elif kind == "record":
            r.record(name, stream)
        elif kind == "wait":
            r.wait(name, stream)
        else:
            r.host_sync()
    reach, races = brute_force(prog)
    assert {(x.first.index, x.second.index) for x in r.races} == races
    ops = [op for op in r.ops if op.kind != "sync"]
    got = {(a.index, b.index) for a in ops for b in ops if r.happens_before(a, b)}
    assert got == {(a.index, b.index) for a in ops for b in ops if a.index < b.index and reach[a.index][b.index]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_schedules_refuse_to_start_without_cuda():
    from moe_lora_harness.kernels.schedule.cuda import CudaSchedule

    from .sleepy import SleepySchedule
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaSchedule()
    with pytest.raises(TypeError, match="inner must be a CudaSchedule"):
        SleepySchedule(Recorder())
