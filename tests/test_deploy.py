"""Serving behind a load balancer: uvicorn's keep-alive outlives the balancer's idle timeout, and
`tpuscore serve`'s flags reach uvicorn and the app.
"""

import pytest
import uvicorn

from tpuscore.cli import commands as cli
from tpuscore.serving import app as server

CASE = "qwen3_seq_cls"  # a classifier: the default rerank template fits it
COMMON_LB_IDLE_TIMEOUT_S = 60  # AWS ALB's default; GCP's and nginx's are at most this


class Captured(Exception):
    """Raised by the patched uvicorn.Server.run: the config is built, nothing listens."""


@pytest.fixture
def captured(monkeypatch):
    configs = []

    def run(self, sockets=None):
        configs.append(self.config)
        raise Captured

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return configs


def test_run_passes_keep_alive_to_uvicorn(scorers, captured):
    app = server.create_app(scorers(CASE))
    with pytest.raises(Captured):
        server.run(app, port=0)
    assert captured[-1].timeout_keep_alive == server.DEFAULT_KEEP_ALIVE_S
    assert server.DEFAULT_KEEP_ALIVE_S > COMMON_LB_IDLE_TIMEOUT_S
    with pytest.raises(Captured):
        server.run(app, port=0, timeout_keep_alive=120)
    assert captured[-1].timeout_keep_alive == 120
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        server.run(app, port=0, timeout_keep_alive=0)


def test_serve_flags_reach_uvicorn_and_the_app(checkpoint_dir, captured, capsys):
    model = str(checkpoint_dir(CASE))
    with pytest.raises(Captured):
        cli.main(["serve", "--model", model, "--port", "0"])
    assert captured[-1].timeout_keep_alive == server.DEFAULT_KEEP_ALIVE_S  # the CLI's default
    with pytest.raises(Captured):
        cli.main(
            [
                "serve",
                "--model",
                model,
                "--port",
                "0",
                "--timeout-keep-alive",
                "90",
                "--metrics-names",
                "vllm",
            ]
        )
    config = captured[-1]
    assert config.timeout_keep_alive == 90
    assert config.app.state.service.metrics.vllm is not None
    status = cli.main(["serve", "--model", model, "--port", "0", "--timeout-keep-alive", "0"])
    assert status != 0 and "--timeout-keep-alive" in capsys.readouterr().err
