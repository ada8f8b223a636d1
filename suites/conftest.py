"""Fixtures of our suites (kept here, not in the plugin, so they never shadow a user's own fixtures)."""
from __future__ import annotations

import os

import pytest
import torch

from moe_lora_harness.harness.draw.cache import CACHE_ENV
from moe_lora_harness.harness.execution.device import interpret_without_cuda, interpreter_switch_kept
from moe_lora_harness.harness.front.pytest_plugin import selected_backends, selected_device
from moe_lora_harness.harness.execution.worker import share_cores

interpret_without_cuda()   # before any suite module imports our Triton kernels (even one module run alone)


def _share_cores_among_xdist_workers() -> None:
    """Under pytest-xdist each test process, and the backend workers and EP ranks it starts, takes its share of
    the cores for torch's threads (unless OMP_NUM_THREADS is set): 2 workers with 2 threads each on 2 cores made
    the suites' tiny float64 GEMMs 30-100x slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share_cores(os.environ, workers)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_cores_among_xdist_workers()


@pytest.fixture(autouse=True)
def _interpreter_switch_kept():
    """No test leaves the interpreter switched for the next one in its process (harness.execution.device.interpreter_switch_kept:
    on the H200 a test's in-process `--device cpu` left it on, and planted mutants jitted later raised there)."""
    with interpreter_switch_kept():
        yield


@pytest.fixture(autouse=True)
def _kernels_interpreted_as_the_harness_runs_them(request):
    """A test that launches our Triton kernels itself gets the interpreter a harness run gets (LaunchWatch: no
    integer-overflow checks, whose asserts the interpreter drops anyway; one language patch per launch; the dtype
    memo): the kernel, expert, schedule and layer suites took 149 worker-seconds instead of 176. Tests of those
    settings mark themselves `interpreter_as_is`."""
    if request.node.get_closest_marker("interpreter_as_is"):
        yield
        return
    from moe_lora_harness.harness.execution.interpreter import LaunchWatch
    with LaunchWatch():
        yield


@pytest.fixture(scope="session")
def device(request) -> str:
    return selected_device(request.config)


@pytest.fixture(scope="session")
def backends(request):
    return selected_backends(request.config)


@pytest.fixture(scope="session")
def executor(request):
    """The supervised worker of this test process (or in-process calls with --moe-lora-in-process)."""
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.execution.worker import DEFAULT_TIMEOUT, Supervisor
    if request.config.getoption("moe_lora_in_process"):
        yield InProcess()
        return
    with Supervisor(timeout=request.config.getoption("moe_lora_case_timeout") or DEFAULT_TIMEOUT) as s:
        yield s


@pytest.fixture(scope="session")
def probe_unsupported(request) -> bool:
    return request.config.getoption("moe_lora_probe_unsupported")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Our tests neither read nor write the user's cache (fuzz corpus, example database): one of their own."""
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("moe-lora-harness-cache"))
    from moe_lora_harness.harness.draw.cache import keep_hypothesis_files_here
    keep_hypothesis_files_here()     # hypothesis' own files too (set at import, before this cache existed)
