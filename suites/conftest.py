"""Fixtures of our suites (kept here, not in the plugin, so they never shadow a user's own fixtures)."""
from __future__ import annotations

import os

import pytest

from moe_lora_harness.harness.cache import CACHE_ENV
from moe_lora_harness.harness.device import interpret_without_cuda
from moe_lora_harness.harness.pytest_plugin import selected_backends, selected_device

interpret_without_cuda()   # before any suite module imports our Triton kernels (even one module run alone)


@pytest.fixture(scope="session")
def device(request) -> str:
    return selected_device(request.config)


@pytest.fixture(scope="session")
def backends(request):
    return selected_backends(request.config)


@pytest.fixture(scope="session")
def probe_unsupported(request) -> bool:
    return request.config.getoption("moe_lora_probe_unsupported")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Our tests neither read nor write the user's cache (fuzz corpus, example database): one of their own."""
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("moe-lora-harness-cache"))
