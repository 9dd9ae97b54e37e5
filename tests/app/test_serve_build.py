"""``serve build`` writes a Serve config that ``serve deploy``'s schema accepts."""

import subprocess
import sys
from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema


def test_serve_build_writes_a_deployable_config(tmp_path):
    out = tmp_path / "serve.yaml"
    serve_cli = Path(sys.executable).with_name("serve")
    result = subprocess.run(
        [str(serve_cli), "build", "app.apps:disagg", "-o", str(out)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "app.apps:disagg"
    deployments = {d["name"]: d for d in app["deployments"]}
    assert set(deployments) == {"PrefillServer", "DecodeServer", "OpenAIIngress", "AutoscalerController"}
    router = deployments["DecodeServer"]["request_router_config"]["request_router_class"]
    assert router == "deployments.router.RoleAwareRouter"
    for name, deployment in deployments.items():  # Serve notices a dead replica at its next check
        assert deployment["health_check_period_s"] == 2.0, name
