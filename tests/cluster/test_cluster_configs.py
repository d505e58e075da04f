"""cluster/configs/*.yaml pass the checks `ray up` runs first (Ray's own defaults merge and JSON schema),
and the job's runtime environment is one Ray accepts. Nothing is launched and no address is contacted."""

from pathlib import Path

import pytest
from raytest import ROOT

pytestmark = pytest.mark.ray
CONFIGS = sorted((ROOT / "cluster" / "configs").glob("*.yaml"))


def test_there_are_gpu_cluster_configs():
    assert {p.name for p in CONFIGS} >= {"gpu-aws.yaml", "gpu-onprem.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_cluster_config_is_valid_for_ray_up(path: Path):
    pytest.importorskip("ray")
    yaml = pytest.importorskip("yaml")
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(config))
    assert config["file_mounts"] == {"~/dynmoe_dist": "."}  # the checkout that setup_commands installs
    assert any("dynmoe_dist[ray" in command for command in config["setup_commands"])


def test_runtime_env_is_accepted_by_ray():
    pytest.importorskip("ray")
    yaml = pytest.importorskip("yaml")
    from ray.runtime_env import RuntimeEnv

    env = RuntimeEnv(**yaml.safe_load((ROOT / "cluster" / "runtime_env.yaml").read_text()))
    assert "runs/" in env["excludes"] and env["env_vars"]["PYTHONUNBUFFERED"] == "1"
