"""The reliability tier's app: one deployment (auth on, loopback providers, simulated replicas) for
every test in this folder, in the session's Ray Serve; removed when the folder's tests are done."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from loadtest.common.reliability import Keys, export_provider_key, new_secret, reliability_config

APP = "llmc-rel"
PREFIX = "/rel"
LONG = os.environ.get("LLMC_LONG") == "1"
# Now, at collection, before any test starts Ray: its workers inherit the key from this process.
PROVIDER_KEY = export_provider_key()
CANARY = new_secret("sk-canary")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: faults under load, fuzzing, soak, accounting, security")


@dataclass
class RelApp:
    cluster: Any  # tests.conftest.RunningCluster
    keys: Keys
    oai: Any
    ant: Any
    canary: str  # a fake secret in a backend's `env` (Ray's runtime_env)

    @property
    def name(self) -> str:
        return self.cluster.cfg.name

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    @property
    def url(self) -> str:
        return self.cluster.url


@pytest.fixture(scope="package")
def rel(deploy) -> Iterator[RelApp]:
    from fixtures.servers.anthropic_server import AnthropicServer
    from fixtures.servers.openai_server import OpenAIServer

    keys = Keys(provider=PROVIDER_KEY)
    with (
        OpenAIServer(api_key=keys.provider, output_tokens=12, token_delay_s=0.01) as oai,
        AnthropicServer(api_key=keys.provider, output_tokens=12, token_delay_s=0.01) as ant,
    ):
        cfg = reliability_config(APP, oai.base_url, ant.base_url, keys, canary=CANARY)
        cluster = deploy(cfg, route_prefix=PREFIX, keep=True)  # the package's app
        yield RelApp(cluster, keys, oai, ant, CANARY)
        from ray import serve

        with contextlib.suppress(Exception):
            serve.delete(APP)
