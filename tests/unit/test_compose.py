"""docker-compose.yml against the compose-spec schema, and against the rest of deploy/."""
from __future__ import annotations

import copy
import functools
import json
import os
import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("check_jsonschema", reason="check-jsonschema (dev extra) vendors the schema")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
MODEL_SERVICES = ("target", "draft", "coordinator")
METRICS_PORTS = {"coordinator": 9400, "draft": 9401, "target": 9402}


@functools.lru_cache(maxsize=1)
def compose_validator():
    path = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(path.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(doc: dict) -> None:
    compose_validator().validate(doc)


def read_env(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} substitution ($$ is a literal $)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if name in env and (env[name] != "" or op != ":-"):
            return env[name]
        if op is None:
            raise KeyError(f"{name} has no default and is not set")
        return default
    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", sub, text)


def substitute(node, env: dict[str, str]):
    # Compose interpolates values after parsing the YAML (never comments, never keys).
    if isinstance(node, dict):
        return {k: substitute(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def load(env: dict[str, str] | None = None) -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    return doc if env is None else substitute(doc, env)


def device_ids(doc: dict, service: str) -> list[str]:
    return doc["services"][service]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]


def flag(doc: dict, service: str, name: str) -> str:
    values = [a.split("=", 1)[1] for a in doc["services"][service]["command"] if a.startswith(name + "=")]
    assert len(values) == 1, f"{service}: {name}"
    return values[0]


def test_compose_validates_as_written():
    validate(load())


VARIANTS = ["defaults", "one-gpu", "tp2"]
# Per variant: the target's device_ids, its tensor-parallel size, the draft's device_ids.
GPUS = {"defaults": (["0"], 1, ["1"]), "one-gpu": (["0"], 1, ["0"]), "tp2": (["0,1"], 2, ["1"])}


def variant_env(variant: str) -> dict[str, str]:
    return {} if variant == "defaults" else read_env(ROOT / "deploy" / f"{variant}.env")


@pytest.mark.parametrize("variant", VARIANTS)
def test_compose_validates_after_substitution(variant):
    doc = load(variant_env(variant))
    validate(doc)
    target_gpus, tp, draft_gpus = GPUS[variant]
    assert device_ids(doc, "target") == target_gpus and device_ids(doc, "draft") == draft_gpus
    # As many GPUs in the target's container as ranks (Docker joins device_ids with commas).
    assert len(target_gpus[0].split(",")) == tp == int(flag(doc, "target", "--tensor-parallel-size"))
    shared = set(target_gpus[0].split(",")) & set(draft_gpus[0].split(","))
    for s in ("target", "draft"):
        kv = flag(doc, s, "--kv-memory")
        assert re.fullmatch(r"\d+GiB", kv)
        if shared:  # a GPU both servers use: explicit budgets that fit an H200 (141 GB) together
            assert variant_env(variant).get(f"{s.upper()}_KV_MEMORY") == kv
    if shared:
        assert sum(int(flag(doc, s, "--kv-memory")[:-3]) for s in ("target", "draft")) <= 32
    assert re.fullmatch(r"\d+[gm]b", doc["services"]["target"]["shm_size"])


def test_schema_is_enforced():
    doc = load()
    bad = copy.deepcopy(doc)
    bad["services"]["target"]["healthcheck"]["intervall"] = "5s"  # a typo is not a field
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(doc)
    bad["services"]["target"]["gpu_count"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(doc)
    bad["services"]["coordinator"]["depends_on"]["target"]["condition"] = "healthy"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_services_models_health_and_ports():
    doc = load({})
    services = doc["services"]
    assert set(services) == {"target", "draft", "coordinator", "prometheus", "grafana"}
    for name in MODEL_SERVICES:
        s = services[name]
        assert any(v.endswith(":/models:ro") for v in s["volumes"]), name
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"
        test = s["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "deploy/healthcheck.py"]
        assert test[3] == f"localhost:{flag(doc, name, '--port')}"
        assert int(flag(doc, name, "--metrics-port")) == METRICS_PORTS[name]
    assert services["coordinator"]["depends_on"]["target"]["condition"] == "service_healthy"
    assert services["coordinator"]["depends_on"]["draft"]["required"] is False
    assert flag(doc, "coordinator", "--target") == "target:" + flag(doc, "target", "--port")
    assert flag(doc, "coordinator", "--draft") == "draft:" + flag(doc, "draft", "--port")


def test_prometheus_scrapes_the_metrics_ports():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    scraped = {job["job_name"]: job["static_configs"][0]["targets"] for job in prom["scrape_configs"]}
    assert scraped == {name: [f"{name}:{port}"] for name, port in METRICS_PORTS.items()}
    for job in prom["scrape_configs"]:
        # A target label named `role` would clash with the metrics' own and rename it.
        assert "labels" not in job["static_configs"][0]


def test_mounted_files_exist_and_grafana_is_provisioned():
    doc = load({})
    for name in ("prometheus", "grafana"):
        for volume in doc["services"][name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/specdec.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in doc["services"]["grafana"]["volumes"]
    home = doc["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/specdec.json"
    assert os.path.exists(ROOT / "deploy" / "Dockerfile")


def test_dockerfile_pins_base_and_dependencies():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base
    assert "tomllib" in text and "pip install --no-deps ." in text  # deps exactly from pyproject
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert all("==" in d for d in deps), "the image installs pyproject's dependencies: pin them"


def test_the_image_can_build_tritons_launcher():
    # Triton compiles a C launcher at the first kernel run on the GPU (triton/runtime/build.py):
    # a compiler, libc's headers and Python.h must be in the image (a CUDA runtime base has none).
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    installed = set()
    for line in re.findall(r"apt-get install ([^&]*)", text.replace("\\\n", " ")):
        installed |= {w for w in line.split() if not w.startswith("-")}
    assert {"gcc", "libc6-dev", "python3-dev"} <= installed, installed


@pytest.mark.parametrize("variant", VARIANTS)
def test_commands_are_accepted_by_the_real_command_lines(variant):
    # Each model service's command, after substitution, parses with the parser its module runs
    # (schema validation cannot catch a renamed or missing flag).
    from coordinator.__main__ import parse_args
    from specdec.serving.server import config_from_args

    services = load(variant_env(variant))["services"]
    for name in MODEL_SERVICES:
        command = services[name]["command"]
        module = f"{name}_server" if name != "coordinator" else "coordinator"
        assert command[:3] == ["python", "-m", module], name
        if name == "coordinator":
            config = parse_args(command[3:])
            assert (config.port, config.metrics_port) == (50050, METRICS_PORTS[name])
            assert config.pipeline == "auto"  # on only where the servers report different GPUs
        else:
            config, metrics_port, _ = config_from_args(name, command[3:])
            assert config.engine.device == "cuda:0" and metrics_port == METRICS_PORTS[name]
            tp = GPUS[variant][1] if name == "target" else 1
            assert config.engine.tensor_parallel_size == tp, name
