"""Serving behind a load balancer: uvicorn's keep-alive outlives the balancer's idle timeout, and
`tpuscore serve`'s flags reach uvicorn and the app.
"""

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import uvicorn
import yaml

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


# -- Kubernetes: deploy/ renders (kubectl kustomize) and validates against the schemas offline --

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir())
# The oldest release whose schema has the preStop sleep action (beta and on from 1.30), and the
# newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
ACCELERATOR = {"cpu": None, "nvidia-gpu": "nvidia.com/gpu", "tpu": "google.com/tpu"}


def render(overlay: str) -> list[dict]:
    """`kubectl kustomize` of an overlay: its objects. Skipped only where kubectl is absent
    (.ci/run installs it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (apt-get install kubernetes-client)")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [obj for obj in yaml.safe_load_all(done.stdout) if obj]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    kinds = [obj["kind"] for obj in objects]
    assert len(kinds) == len(set(kinds)), kinds
    return {obj["kind"]: obj for obj in objects}


def test_every_accelerator_has_an_overlay():
    assert sorted(ACCELERATOR) == OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    objects = render(overlay)
    assert sorted(obj["kind"] for obj in objects) == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
        "Service",
    ]
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except Exception as e:  # kubernetes_validate's and jsonschema's errors
                pytest.fail(f"{overlay}: {obj['kind']} against Kubernetes {version}: {e}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_wired_together(overlay):
    """What a schema cannot see: the pieces name each other, and the server's flags parse."""
    kinds = by_kind(render(overlay))
    deployment, service, hpa = (
        kinds["Deployment"],
        kinds["Service"],
        kinds["HorizontalPodAutoscaler"],
    )
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in ports

    # The command line is tpuscore serve's, and every flag parses.
    assert container["command"] == ["tpuscore", "serve"]
    args = cli._parser().parse_args(["serve", *container["args"]])
    assert args.host == "0.0.0.0" and args.port == ports["http"]
    assert args.timeout_keep_alive > COMMON_LB_IDLE_TIMEOUT_S
    assert args.metrics_names in ("tpuscore", "both")  # the autoscaler's series is tpuscore's
    if overlay == "tpu":
        assert args.mesh == "4x1"

    # Probes on /health; a preStop that drains within the grace period.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop + args.request_timeout < grace

    # The compilation cache on the claimed volume, where TPUSCORE_COMPILATION_CACHE points.
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = container["volumeMounts"]
    assert env["TPUSCORE_COMPILATION_CACHE"].startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    claim = kinds["PersistentVolumeClaim"]["metadata"]["name"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim

    # Resources per accelerator kind.
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    accelerator = ACCELERATOR[overlay]
    extended = {k for k in resources.get("limits", {}) if "/" in k}
    assert extended == ({accelerator} if accelerator else set())

    # The autoscaler scales this Deployment on the queue gauge the server exports.
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "tpuscore_requests_waiting"


def test_the_autoscaled_gauge_is_exported(scorers):
    """deploy/base/hpa.yaml's metric is a series `tpuscore serve` exports."""
    app = server.create_app(scorers(CASE))
    assert b"\ntpuscore_requests_waiting 0.0\n" in app.state.service.metrics.text()
