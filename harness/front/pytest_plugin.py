"""The pytest plugin (entry point `pytest11`): options, per-test timeout, and a count of tests that never ran.

Loaded by every pytest session of an environment that has moe-lora-harness installed, so it imports
nothing heavy and changes nothing unless our suites run: `pytest --pyargs moe_lora_harness.suites
--moe-lora-backend mypkg.moe:fused_moe_lora`. Options (all prefixed, so they clash with no other
plugin): --moe-lora-device, --moe-lora-backend (repeatable), --moe-lora-only (repeatable),
--moe-lora-probe-unsupported, --moe-lora-cases-per-feature, --moe-lora-profile, --moe-lora-max-examples,
--moe-lora-case-timeout, --moe-lora-test-timeout, --moe-lora-in-process, --moe-lora-tier.
"""
from __future__ import annotations

import faulthandler
import functools
import os
import pathlib
import signal
import sys

import pytest

SUITES_DIR = pathlib.Path(__file__).resolve().parents[2] / "suites"
TEST_TIMEOUT_DEFAULT = 900.0
TIERS = ("gate", "full")
TIER_ENV = "MOE_LORA_HARNESS_TIER"
_NEVER_RAN = pytest.StashKey[list]()
_FULL_TIER = pytest.StashKey[int]()
_ALONE = pytest.StashKey[int]()
ALONE_ARGS = "-m gpu_alone -p no:xdist"     # what runs the gpu_alone tests apart, added to the session's own arguments


def pytest_addoption(parser):
    g = parser.getgroup("moe-lora-harness", "moe-lora-harness conformance suites")
    g.addoption("--moe-lora-device", default=None, metavar="cpu|cuda|cuda:N",
                help="device to test on (default: cuda when available)")
    g.addoption("--moe-lora-backend", action="append", default=[], metavar="MODULE:ATTR",
                help="add a backend: a BackendSpec, a list of them, or a fused_moe_lora-signature function "
                     "(MODULE may be path/to/file.py)")
    g.addoption("--moe-lora-only", action="append", default=[], metavar="NAME",
                help="run only these backends (short name or the MODULE:ATTR they came from)")
    g.addoption("--moe-lora-probe-unsupported", action="store_true",
                help="also run cases a backend declines; warn about the ones that pass")
    g.addoption("--moe-lora-cases-per-feature", type=int, default=None, metavar="N",
                help="cases per feature and backend (default on CPU 1 in the gate tier, 2 in the full tier; 3 on "
                     "CUDA)")
    g.addoption("--moe-lora-profile", default=None, choices=("ci", "dev", "fuzz"),
                help="hypothesis profile of our suites (default: $MOE_LORA_HARNESS_PROFILE or ci, derandomized)")
    g.addoption("--moe-lora-max-examples", type=int, default=None, metavar="N",
                help="examples per hypothesis test of our suites ($MOE_LORA_HARNESS_MAX_EXAMPLES)")
    g.addoption("--moe-lora-case-timeout", type=float, default=None, metavar="SECONDS",
                help="per backend call in the supervised worker (default 300)")
    g.addoption("--moe-lora-test-timeout", type=float, default=TEST_TIMEOUT_DEFAULT, metavar="SECONDS",
                help=f"per test of our suites (default {TEST_TIMEOUT_DEFAULT:.0f}; 0 = none)")
    g.addoption("--moe-lora-tier", default=None, choices=TIERS,
                help="gate: the CPU gate CI runs (tests marked `slow`, the full tier's cross-products and end-to-end "
                     "campaigns, deselected); full: every test (default: $MOE_LORA_HARNESS_TIER, else gate on CPU "
                     "and full on CUDA)")
    g.addoption("--moe-lora-in-process", action="store_true",
                help="call backends in the test process instead of a supervised worker (for debuggers; a "
                     "crashing backend then takes the test process with it)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (bf16 and real shapes)")
    config.addinivalue_line("markers", "slow: the full tier only (a claim's further cross-products, or an end-to-end "
                                       "campaign whose parts the gate tests): not run in the CPU gate tier")
    config.addinivalue_line("markers", "gpu_alone: production-size CUDA cases that need the GPU to themselves (run "
                                       "them apart from a parallel run: -m gpu_alone without xdist)")
    config.addinivalue_line("markers", "starts_first: one of the suites' longest tests, started before the rest so "
                                       "that a parallel run does not wait for it at its end")
    config.addinivalue_line("markers", "interpreter_as_is: a test of our suites that needs Triton's interpreter with "
                                       "none of the settings a harness run gives it (suites/conftest.py)")
    # our suites read these when their modules are imported (hypothesis settings are set per test, never
    # globally, so a user's own hypothesis tests in the same session keep their profile)
    if config.getoption("moe_lora_profile"):
        os.environ["MOE_LORA_HARNESS_PROFILE"] = config.getoption("moe_lora_profile")
    if config.getoption("moe_lora_max_examples"):
        os.environ["MOE_LORA_HARNESS_MAX_EXAMPLES"] = str(config.getoption("moe_lora_max_examples"))
    keep_pytest_cache_out_of_the_working_directory(config)
    dev = config.getoption("moe_lora_device")
    if dev is not None:
        from moe_lora_harness.harness.execution.device import parse_device
        try:
            parse_device(dev, "--moe-lora-device")
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


def tier(config) -> str:
    """gate or full (--moe-lora-tier, else $MOE_LORA_HARNESS_TIER, else gate on a CPU device, full on CUDA)."""
    chosen = config.getoption("moe_lora_tier") or os.environ.get(TIER_ENV)
    if chosen:
        if chosen not in TIERS:
            raise pytest.UsageError(f"${TIER_ENV} must be one of {', '.join(TIERS)}; got {chosen!r}")
        return chosen
    return "gate" if selected_device(config) == "cpu" else "full"


def full_tier_marks(spec, device: str) -> tuple:
    """The `slow` mark (the full tier only) for a variant backend's conformance on the CPU
    (BackendSpec.cpu_rows_in_full_tier); no mark otherwise."""
    return (pytest.mark.slow,) if spec.cpu_rows_in_full_tier and device == "cpu" else ()


def pytest_collection_modifyitems(config, items):
    """The gate tier deselects our tests marked `slow`; a parallel session on a CUDA device, those marked
    `gpu_alone` (production-size cases: two at once do not fit an 80 GB GPU). Each counted in the summary, never
    silent. Our tests marked `starts_first` go to the front, in their order: pytest-xdist hands tests out in
    collection order, and the gate's longest (15 s) was collected last, one worker idle while it ran."""
    ours = [i for i in items if is_ours(i)]
    if not ours:
        return
    first = [i for i in ours if i.get_closest_marker("starts_first")]
    if first:
        ahead = set(map(id, first))
        items[:] = first + [i for i in items if id(i) not in ahead]
    left_out = []
    if tier(config) != "full":
        slow = [i for i in ours if i.get_closest_marker("slow")]
        config.stash[_FULL_TIER] = len(slow)
        left_out += slow
    if parallel(config) and selected_device(config) != "cpu":
        alone = [i for i in ours if i.get_closest_marker("gpu_alone") and i not in left_out]
        config.stash[_ALONE] = len(alone)
        left_out += alone
    if left_out:
        keep = set(map(id, left_out))
        items[:] = [i for i in items if id(i) not in keep]
        config.hook.pytest_deselected(items=left_out)


def parallel(config) -> bool:
    """Whether this session's tests run in more than one pytest-xdist worker (asked in a worker or the controller;
    not from $PYTEST_XDIST_WORKER_COUNT, which a worker's children inherit: a pytest a test starts is not parallel)."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        return int(worker.get("workercount", 1)) > 1
    n = getattr(getattr(config, "option", None), "numprocesses", None)
    try:
        return n in ("auto", "logical") or (n is not None and int(n) > 1)
    except (TypeError, ValueError):
        return False


def _only_our_suites(config) -> bool:
    """Whether the session runs our suites alone (`--pyargs moe_lora_harness.suites...`, or their paths)."""
    pyargs = bool(getattr(config.option, "pyargs", False))
    args = [str(a).split("::", 1)[0] for a in config.args]

    def ours(arg: str) -> bool:
        if pyargs and (arg == "moe_lora_harness.suites" or arg.startswith("moe_lora_harness.suites.")):
            return True
        try:
            return pathlib.Path(arg).resolve().is_relative_to(SUITES_DIR)
        except (OSError, ValueError):
            return False
    return bool(args) and all(ours(a) for a in args)


def keep_pytest_cache_out_of_the_working_directory(config) -> None:
    """A run of our suites alone from a folder with no pytest configuration of its own (a user's `pytest
    --pyargs moe_lora_harness.suites ...`) keeps pytest's cache under the harness cache, not ./.pytest_cache."""
    cache = getattr(config, "cache", None)      # None under -p no:cacheprovider
    if cache is None or config.inipath is not None or not _only_our_suites(config):
        return
    from moe_lora_harness.harness.draw.cache import cache_dir
    if hasattr(cache, "_cachedir"):             # pytest.Cache keeps its folder there (no public setter)
        cache._cachedir = cache_dir() / "pytest-cache"


# -- what our suites ask of the session ----------------------------------------------------------------------

def selected_device(config) -> str:
    """The device of this session (validated; cuda without a GPU is a usage error)."""
    from moe_lora_harness.harness.execution.device import prepare_device
    try:
        return prepare_device(config.getoption("moe_lora_device"), "--moe-lora-device")
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


_BACKENDS: dict = {}


def selected_backends(config):
    """name -> BackendSpec for this session (loaded once per process)."""
    key = (tuple(config.getoption("moe_lora_backend")), tuple(config.getoption("moe_lora_only")))
    if key not in _BACKENDS:
        from moe_lora_harness.harness.spec.registry import BackendLoadError, available_backends, select
        try:
            _BACKENDS[key] = select(available_backends(extra_refs=key[0]), key[1])
        except BackendLoadError as e:
            raise pytest.UsageError(str(e)) from None
    return _BACKENDS[key]


def is_ours(item) -> bool:
    """True for a test of moe-lora-harness's own suites (the timeout and never-ran count apply to them)."""
    try:
        return pathlib.Path(str(item.path)).resolve().is_relative_to(SUITES_DIR)
    except (OSError, ValueError):
        return False


# -- per-test timeout -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _test_timeout_class():
    from moe_lora_harness.harness.execution.execute import HarnessInterrupt

    class TestTimeout(HarnessInterrupt):
        """A test of our suites ran past --moe-lora-test-timeout (passes through a backend's own except)."""

        __test__ = False
    return TestTimeout


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("moe_lora_test_timeout") or 0
    armed = limit > 0 and is_ours(item) and hasattr(signal, "SIGALRM") and _main_thread()
    if armed:
        timeout_error = _test_timeout_class()

        def on_alarm(signum, frame):
            raise timeout_error(f"{item.nodeid} ran past --moe-lora-test-timeout={limit:g}s")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        # a hang the alarm cannot interrupt (inside C code): dump every stack and end the process
        try:
            faulthandler.dump_traceback_later(limit + 60, exit=True, file=sys.__stderr__)
        except (ValueError, OSError, AttributeError):   # no real stderr to write to: the alarm alone
            pass
    try:
        yield
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            faulthandler.cancel_dump_traceback_later()


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


# -- tests that never ran ---------------------------------------------------------------------------------------

class _Ledger:
    """Collected test ids against reported ones (under xdist: on the controller, from the workers' reports)."""

    def __init__(self):
        self.collected: list[str] = []
        self.ours = False
        self.reported: set[str] = set()


_LEDGER = _Ledger()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):   # not an xdist worker
        _LEDGER.collected = [i.nodeid for i in session.items]
        _LEDGER.ours = any(is_ours(i) for i in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if not _LEDGER.collected:
        _LEDGER.collected = list(ids)
        _LEDGER.ours = any(_id_is_ours(i, node.config) for i in ids)


def _id_is_ours(nodeid: str, config) -> bool:
    path = pathlib.Path(str(config.rootpath), nodeid.split("::", 1)[0])
    try:
        return path.resolve().is_relative_to(SUITES_DIR)
    except (OSError, ValueError):
        return False


def pytest_runtest_logreport(report):
    _LEDGER.reported.add(report.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _LEDGER.ours or session.config.option.collectonly:
        return      # (--collect-only runs nothing by design)
    never = [i for i in _LEDGER.collected if i not in _LEDGER.reported]
    session.config.stash[_NEVER_RAN] = never
    if never and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.stash.get(_FULL_TIER, None)     # known in this process (not on the xdist controller)
    if _LEDGER.ours and tier(config) == "gate" and n != 0:
        terminalreporter.line(f"moe-lora-harness: the gate tier ran; {'any' if n is None else n} tests marked slow "
                              f"(the full tier) were deselected: --moe-lora-tier full runs every test")
    alone = config.stash.get(_ALONE, None)
    ours = _LEDGER.ours or _only_our_suites(config)     # (a run of gpu_alone tests alone reports none of ours)
    if ours and alone != 0 and (alone is not None or (parallel(config) and selected_device(config) != "cpu")):
        terminalreporter.line(f"moe-lora-harness: {'any' if alone is None else alone} production-size tests (marked "
                              f"gpu_alone) were deselected: they need the GPU to themselves; run them apart: the "
                              f"same command without -n, with {ALONE_ARGS}")
    never = config.stash.get(_NEVER_RAN, [])
    if not never:
        return
    tr = terminalreporter
    tr.section("moe-lora-harness: tests that never ran", sep="=", red=True, bold=True)
    tr.line(f"{len(never)} of {len(_LEDGER.collected)} collected tests never ran (a worker died, the run was "
            f"stopped, or a test hung past its timeout); the verdict is incomplete:")
    for nodeid in never[:20]:
        tr.line(f"  {nodeid}")
    if len(never) > 20:
        tr.line(f"  ... and {len(never) - 20} more")
    sys.stdout.flush()
