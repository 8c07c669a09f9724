"""The Helm chart helm/dsde, rendered by Helm itself: helm-python-sdk binds Helm v4's Go SDK (libhelm_c, the same
engine, template functions, values coalescing and values.schema.json check as the `helm` binary), offline.

- values.yaml validates against values.schema.json (jsonschema), and Helm enforces the schema on bad values;
- `helm lint --strict` finds no warning;
- the RayService validates against KubeRay's CRD schema (tests/data/ray.io_rayservices.yaml.gz), made strict the way
  `kubectl apply --validate=strict` is (an unknown field is an error), and its pod templates validate as Pods;
- the ConfigMap validates with kubernetes-validate (strict), the PodMonitor and the PrometheusRule (the rules and
  alerts of deploy/prometheus/rules, verbatim) against the Prometheus Operator's models;
- the serve config is deploy/config.yaml's application (serve.autoscaling merged over its autoscaling_config); the
  head schedules no work; the GPU workers ask for GPUs; KubeRay's autoscaler may add the workers more replicas need;
- the split placement (splitPlacement): a CPU group for drafts and the GPU group for targets, each advertising the
  custom resource the app args ask for, in the form `ray start --resources` reads through KubeRay's shell command,
  and a cluster of one pod of each holds a replica's actors (services.config_file.unplaced).
"""

from __future__ import annotations

import copy
import gzip
import json
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm  # helm-python-sdk, extra `ops` (make setup): a missing one fails, never skips
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.ops_support import GRAFANA_DIR, PROMETHEUS_DIR, ROOT

CHART = ROOT / "helm" / "dsde"
# KubeRay's RayService CRD (ray-operator/config/crd/bases/ray.io_rayservices.yaml, commit feeaf72f of 2026-08-19,
# Apache-2.0), the copy in ../shared/k8s vendored here so that a clone anywhere runs the test.
CRD = Path(__file__).parent / "data" / "ray.io_rayservices.yaml.gz"
K8S_VERSION = "1.37.0"  # kubernetes-validate's newest schemas
RELEASE, NAMESPACE = "demo", "llm"


def render(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """kind -> object (NOTES.txt as text) of the chart rendered with `values` over values.yaml."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: dict[str, Any] = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            objects["NOTES"] = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in objects, path
                objects[doc["kind"]] = doc
    return objects


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected: every object schema that lists its properties (and does not say
    it keeps unknown fields) gets additionalProperties: false, as the API server's strict field validation does."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    assert crd["spec"]["names"]["kind"] == "RayService"
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return _strict(v1["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def default() -> dict[str, Any]:
    return render()


def _deploy_app() -> dict[str, Any]:
    [app] = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())["applications"]
    return app


def _serve_config(objects: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(objects["RayService"]["spec"]["serveConfigV2"])


# ---- values -------------------------------------------------------------------------------------------------------
def test_values_yaml_validates_against_values_schema_json() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.mark.parametrize("bad", [{"worker": {"gpus": -1}}, {"worker": {"gpu": 1}},
                                 {"image": {"pullPolicy": "Sometimes"}},
                                 {"monitoring": {"podMonitor": {"interval": "soon"}}},
                                 {"serve": {"autoscaling": {"max_replicas": 0}}},
                                 {"splitPlacement": {"strategy": "SPREAD_THIN"}},
                                 {"splitPlacement": {"draftResource": "has space"}},
                                 {"autoscaler": {"upscalingMode": "Eager"}}])
def test_helm_rejects_values_the_schema_forbids(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError, match="schema|want|not allowed|must be|value must be one of"):
        render(bad)


def test_helm_lint_strict_finds_nothing_to_fix() -> None:
    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # 2: warning, 3: error


# ---- the RayService -----------------------------------------------------------------------------------------------
def test_rayservice_validates_against_kuberays_crd_schema(default: dict[str, Any], crd_schema: dict[str, Any]) -> None:
    rayservice = default["RayService"]
    assert rayservice["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(crd_schema).validate(rayservice)
    # the strict schema does catch a misspelt field
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.Draft7Validator(crd_schema).validate(broken)


def _pod_templates(objects: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = objects["RayService"]["spec"]["rayClusterConfig"]
    [worker] = cluster["workerGroupSpecs"]
    return {"head": cluster["headGroupSpec"]["template"], "worker": worker["template"]}


def test_pod_templates_and_configmap_validate_as_standard_kubernetes_objects(default: dict[str, Any]) -> None:
    for role, template in _pod_templates(default).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"dsde-{role}", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    kubernetes_validate.validate(default["ConfigMap"], K8S_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # and it is not a rubber stamp
        kubernetes_validate.validate({**default["ConfigMap"], "datas": {}}, K8S_VERSION, strict=True)


def test_serve_config_is_deploy_config_yamls_application(default: dict[str, Any]) -> None:
    from services.config import ServiceConfig

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app = _deploy_app()
    assert values["serve"]["application"] == app  # values.yaml carries it verbatim

    def expected(overrides: dict[str, Any]) -> dict[str, Any]:
        want = copy.deepcopy(app)
        want["args"].update(overrides)
        want["deployments"][0]["autoscaling_config"].update(values["serve"]["autoscaling"])
        # Helm drops null-valued keys of maps in values: a null arg is ServiceConfig's default, so absent == null
        want["args"] = {k: v for k, v in want["args"].items() if v is not None}
        return want

    dropped = {k for k, v in app["args"].items() if v is None}
    defaults = ServiceConfig.from_args({})
    assert all(getattr(defaults, k) is None for k in dropped), dropped

    for overrides, objects in ((values["serve"]["argOverrides"], default),
                               ({}, render({"serve": {"argOverrides": None}}))):
        config = _serve_config(objects)
        [rendered] = config["applications"]
        assert json.dumps(rendered, sort_keys=True) == json.dumps(expected(overrides), sort_keys=True)  # types too
        assert ServiceConfig.from_args(rendered["args"]) == ServiceConfig.from_args({**app["args"], **overrides})
        assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert values["serve"]["argOverrides"] == {"draft_num_gpus": 0.5, "target_num_gpus": 0.5}
    assert values["serve"]["autoscaling"] == {"max_replicas": 2}


def test_the_rendered_serve_config_passes_dsde_check_config(default: dict[str, Any], tmp_path: Path) -> None:
    from services.config_file import check_config_file

    path = tmp_path / "serveConfigV2.yaml"
    path.write_text(default["RayService"]["spec"]["serveConfigV2"])
    [app] = check_config_file(path)
    assert app.config is not None and app.config.target_num_gpus == 0.5 and app.policy is not None
    assert app.autoscaling is not None and app.autoscaling["max_replicas"] == 2
    assert app.autoscaling["target_ongoing_requests"] == app.config.max_batch_size


def test_head_schedules_no_work_and_the_gpu_workers_ask_for_gpus(default: dict[str, Any]) -> None:
    cluster = default["RayService"]["spec"]["rayClusterConfig"]
    head, [worker] = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert worker["rayStartParams"]["num-gpus"] == "1"
    [container] = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert worker["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker["template"]["spec"][
        "tolerations"]
    for template in _pod_templates(default).values():
        [c] = template["spec"]["containers"]
        assert c["image"] == "dsde-serve:0.1.0"
        assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True

    # Helm merges a map given in values into the default one; null removes a default key
    custom = render({"worker": {"gpus": 2, "nodeSelector": {"pool": "a100", "nvidia.com/gpu.present": None},
                                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm",
                                                 "effect": "NoExecute"}]},
                     "image": {"repository": "registry.example/dsde", "tag": "1.2.3"}})
    [worker] = custom["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = worker["template"]["spec"]
    assert worker["rayStartParams"]["num-gpus"] == "2"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert spec["nodeSelector"] == {"pool": "a100"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute"}]
    assert spec["containers"][0]["image"] == "registry.example/dsde:1.2.3"

    cpu_only = render({"worker": {"gpus": 0}, "serve": {"argOverrides": None}})
    [worker] = cpu_only["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert "num-gpus" not in worker["rayStartParams"]
    assert "nvidia.com/gpu" not in worker["template"]["spec"]["containers"][0]["resources"].get("limits", {})


def _advertised(group: dict[str, Any]) -> dict[str, float]:
    """The resources a worker group's pods advertise to Ray: KubeRay runs `ray start --KEY=VALUE ...` through a shell,
    so a `resources` value is what the shell makes of it."""
    params = group["rayStartParams"]
    out = {"CPU": float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])}
    if "num-gpus" in params:
        out["GPU"] = float(params["num-gpus"])
    if "resources" in params:
        [arg] = shlex.split(f"--resources={params['resources']}")
        out.update(json.loads(arg.removeprefix("--resources=")))
    return out


def test_the_workers_autoscale_up_to_the_replicas_serve_may_ask_for(default: dict[str, Any],
                                                                    crd_schema: dict[str, Any]) -> None:
    from services.config_file import unplaced

    cluster = default["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] == {"idleTimeoutSeconds": 60, "upscalingMode": "Default"}
    [worker] = cluster["workerGroupSpecs"]
    [app] = _serve_config(default)["applications"]
    scaling = app["deployments"][0]["autoscaling_config"]
    assert worker["maxReplicas"] >= scaling["max_replicas"] > scaling["min_replicas"] == worker["minReplicas"]
    # one GPU worker holds one replica's pair (half a GPU each), so max_replicas workers hold them all
    from services.config import ServiceConfig

    cfg = ServiceConfig.from_args(app["args"])
    assert unplaced(cfg, [_advertised(worker)]) == []
    assert cfg.resources("draft")["GPU"] + cfg.resources("target")["GPU"] <= _advertised(worker)["GPU"]
    off = render({"autoscaler": {"enabled": False}})["RayService"]
    assert off["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in off["spec"]["rayClusterConfig"]
    jsonschema.Draft7Validator(crd_schema).validate(off)


def test_the_split_placement_puts_drafts_on_a_cpu_group_and_targets_on_the_gpu_group(
        crd_schema: dict[str, Any], tmp_path: Path) -> None:
    from services.config_file import check_config_file, unplaced

    split = render({"splitPlacement": {"enabled": True, "strategy": "STRICT_SPREAD", "draftsPerWorker": 3}})
    rayservice = split["RayService"]
    jsonschema.Draft7Validator(crd_schema).validate(rayservice)
    gpu, cpu = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (gpu["groupName"], cpu["groupName"]) == ("gpu", "cpu")
    assert _advertised(gpu) == {"CPU": 4.0, "GPU": 1.0, "dsde_target": 1}
    assert _advertised(cpu) == {"CPU": 4.0, "dsde_draft": 3}
    cpu_spec = cpu["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu_spec["containers"][0]["resources"]["limits"] and "nodeSelector" not in cpu_spec
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dsde-cpu", **cpu["template"]["metadata"]},
           "spec": cpu_spec}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)

    path = tmp_path / "serveConfigV2.yaml"
    path.write_text(rayservice["spec"]["serveConfigV2"])
    [app] = check_config_file(path)
    cfg = app.config
    assert cfg is not None and cfg.placement_strategy == "STRICT_SPREAD"
    assert cfg.resources("draft") == {"CPU": 2.0, "dsde_draft": 1.0}  # no GPU: the draft runs on the CPU worker
    assert cfg.resources("target") == {"CPU": 1.0, "GPU": 1.0, "dsde_target": 1.0}
    # a GPU pod and a CPU pod hold a replica; without the CPU pod the draft has nowhere to go, said by name
    assert unplaced(cfg, [_advertised(gpu), _advertised(cpu)]) == []
    assert unplaced(cfg, [_advertised(gpu)]) == ["the draft asks for dsde_draft 1 (no node has it)"]
    # the CPU group's pod values are its own
    custom = render({"splitPlacement": {"enabled": True, "cpuWorker": {"maxReplicas": 4, "nodeSelector": {
        "pool": "cpu"}}}})
    _, cpu = custom["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert cpu["maxReplicas"] == 4 and cpu["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}


# ---- monitoring ---------------------------------------------------------------------------------------------------
def test_podmonitor_is_a_valid_prometheus_operator_object_that_selects_the_ray_pods(default: dict[str, Any]) -> None:
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor

    monitor = default["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    model = PodMonitor.model_validate(monitor)
    # every field is one the Operator's schema knows (an unknown one would be dropped by the model)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == monitor
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for template in _pod_templates(default).values():
        assert selector.items() <= template["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    labelled = render({"monitoring": {"podMonitor": {"labels": {"release": "kube-prometheus-stack"}}}})
    assert labelled["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    off = render({"monitoring": {"podMonitor": {"enabled": False}, "grafanaDashboards": {"enabled": False}}})
    assert "PodMonitor" not in off and "ConfigMap" not in off


def test_prometheusrule_carries_the_rules_and_alerts_of_deploy_prometheus(default: dict[str, Any]) -> None:
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule

    source = PROMETHEUS_DIR / "rules" / "dsde.rules.yml"
    assert (CHART / "rules" / "dsde.rules.yml").read_text() == source.read_text(), \
        f"the chart's copy differs: cp {source.relative_to(ROOT)} helm/dsde/rules/"
    rule = default["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    model = PrometheusRule.model_validate(rule)
    assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == rule  # no field the Operator drops
    # the groups verbatim: the alerts' {{ $labels }} templates are Prometheus', left alone by Helm
    assert rule["spec"]["groups"] == yaml.safe_load(source.read_text())["groups"]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {"DSDEWorkerFlapping", "DSDEWorkerDown"}
    labelled = render({"monitoring": {"prometheusRule": {"labels": {"release": "kube-prometheus-stack"}}}})
    assert labelled["PrometheusRule"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "PrometheusRule" not in render({"monitoring": {"prometheusRule": {"enabled": False}}})


def test_dashboards_configmap_carries_both_dashboards_for_the_grafana_sidecar(default: dict[str, Any]) -> None:
    cm = default["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p for p in (GRAFANA_DIR / "dashboards").glob("*.json")}
    assert set(cm["data"]) == set(files) and len(files) == 2
    for name, path in files.items():
        assert json.loads(cm["data"][name]) == json.loads(path.read_text())


def test_notes_tell_how_to_reach_the_service(default: dict[str, Any]) -> None:
    notes = default["NOTES"]
    name = default["RayService"]["metadata"]["name"]
    assert name == "demo-dsde"
    assert f"svc/{name}-serve-svc 8000:8000" in notes and f"get rayservice {name}" in notes
    assert '"model": "qwen2.5-coder-1.5b-instruct"' in notes


def test_chart_is_self_contained() -> None:
    """Helm reads files only inside the chart: the dashboards it ships are real files there (no links out)."""
    for path in (CHART / "dashboards").iterdir():
        assert path.is_file() and not path.is_symlink(), path
    assert Path(CHART / "templates" / "NOTES.txt").exists()
