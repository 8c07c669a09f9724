"""`dsde check-config`: a Serve config file checked without a cluster, each problem named by application and field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsde_cli.main import main
from dsde_core.errors import ConfigError
from services.config import ServiceConfig
from services.config_file import check_config_file

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "config.yaml"


def _write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def _edited(edit: Any) -> dict[str, Any]:
    doc = copy.deepcopy(yaml.safe_load(DEPLOY.read_text()))
    edit(doc["applications"][0])
    return doc


def test_the_shipped_config_passes_and_says_what_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    [app] = check_config_file(DEPLOY)
    args = yaml.safe_load(DEPLOY.read_text())["applications"][0]["args"]
    assert app.config == ServiceConfig.from_args(args)
    assert app.policy is not None and app.policy.policy == "dsde-goodput"
    assert main(["check-config", str(DEPLOY)]) == 0
    out = capsys.readouterr().out
    assert "application 'dsde' at /: serves 'qwen2.5-coder-1.5b-instruct'" in out and out.endswith(": ok\n")


def test_the_deployments_user_config_is_the_one_that_applies(tmp_path: Path) -> None:
    def edit(app: dict[str, Any]) -> None:
        app["args"]["user_config"] = {"policy": "static:3"}
        app["deployments"][0]["user_config"] = {"policy": "dsde-goodput", "max_sl": 8}

    [app] = check_config_file(_write(tmp_path, _edited(edit)))
    assert app.policy is not None and (app.policy.policy, app.policy.max_sl) == ("dsde-goodput", 8)


@pytest.mark.parametrize(("edit", "says"), [
    # the case this exists for: Serve meets it only in the replica's reconfigure, after loading the models
    (lambda a: a["deployments"][0]["user_config"].update(policy="bogus"),
     "application 'dsde': deployments[DSDEServer].user_config: unknown speculation policy 'bogus'"),
    (lambda a: a["deployments"][0]["user_config"].update(params={"nope": 1}),
     "deployments[DSDEServer].user_config: user_config: policy 'dsde-goodput' has no parameter(s) nope"),
    (lambda a: a["deployments"][0].update(user_config="dsde"),
     "Serve's schema: applications.0.deployments.0.user_config: Input should be a valid dictionary"),
    (lambda a: a["args"].update(user_config="dsde"), "args.user_config: a mapping (policy, params, cap, max_sl)"),
    (lambda a: a["args"].update(user_config={"policy": "static:x"}), "args.user_config: policy 'static'"),
    (lambda a: a["args"].update(max_batch_size=0), "application 'dsde': args: max_batch_size must be in [1, 1024]"),
    (lambda a: a["args"].update(device="cuda"), "args: device 'cuda' needs target_num_gpus > 0"),
    (lambda a: a["args"].update(colour="blue"), "args: app args: unknown key(s) colour"),
    (lambda a: a["deployments"][0].update(name="Server"), "no deployment named 'Server' in the application"),
    (lambda a: a["deployments"][0].update(num_replicas="x"), "Serve's schema: applications.0.deployments.0: "),
])
def test_a_problem_is_an_error_naming_the_application_and_the_field(tmp_path: Path, edit: Any, says: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _edited(edit))
    with pytest.raises(ConfigError, match="^" + str(path)):
        check_config_file(path)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dsde: error: {path}: ") and says in err and "Traceback" not in err, err


@pytest.mark.parametrize(("text", "says"), [
    ("applications: [\n", "not YAML at line 2, column 1"),
    ("- a list\n", "not a Serve config file"),
    ("proxy_location: EveryNode\n", "not a Serve config file"),
])
def test_a_file_that_is_no_serve_config_says_so(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        check_config_file(_write(tmp_path, text))
    with pytest.raises(ConfigError, match="No such file"):
        check_config_file(tmp_path / "missing.yaml")


def test_another_application_is_left_to_serve_and_a_model_not_here_is_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _edited(lambda a: a["args"].update(target="/models/not-here"))
    doc["applications"].append({"name": "other", "route_prefix": "/other", "import_path": "mypkg.app:build",
                                "args": {"anything": 1}})
    path = _write(tmp_path, doc)
    dsde, other = check_config_file(path)
    assert dsde.config is not None and other.config is None
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "note: model '/models/not-here' is not on this machine" in out
    assert "application 'other': not DSDE Serve (not checked beyond Serve's schema)" in out


@pytest.mark.parametrize(("args", "user_config", "says"), [
    ({"policy": "static:30"}, "drop", "note: policy static:30 plans k up to 30, above the engine's max_sl 20"),
    ({"max_sl": 8}, {"policy": "dsde"}, "note: policy dsde plans k up to 20, above the engine's max_sl 8"),
    ({}, {"policy": "static", "params": {"k": 24}}, "note: policy static{k=24} plans k up to 24"),
    ({}, {"policy": "static:4", "max_sl": 30},
     "note: user_config max_sl 30, above the engine's max_sl 20: no step drafts more than 20 tokens"),
    ({}, {"policy": "static:30", "max_sl": 10}, None),  # the live ceiling is the operator's own, within the engine's
    ({}, "keep", None),  # the shipped config asks for nothing above its engine
])
def test_a_policy_asking_for_more_than_the_engines_max_sl_is_a_note(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: dict[str, Any], user_config: Any,
        says: str | None) -> None:
    def edit(app: dict[str, Any]) -> None:
        app["args"].update(args)
        if user_config == "drop":  # the args' policy applies
            del app["deployments"][0]["user_config"]
        elif user_config != "keep":
            app["deployments"][0]["user_config"] = user_config

    assert main(["check-config", str(_write(tmp_path, _edited(edit)))]) == 0
    out = capsys.readouterr().out
    if says is None:
        assert "above the engine's max_sl" not in out
    else:
        assert says in out and out.endswith(": ok\n")



# ---- autoscaling and placement ----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # check-config would ask that cluster


def test_the_shipped_config_autoscales_at_max_batch_size_and_says_the_cluster_was_not_asked(
        capsys: pytest.CaptureFixture[str]) -> None:
    [app] = check_config_file(DEPLOY)
    assert app.autoscaling is not None and app.autoscaling["target_ongoing_requests"] == app.config.max_batch_size
    assert main(["check-config", str(DEPLOY)]) == 0
    out = capsys.readouterr().out
    assert "autoscaling from 1 to 1 replicas at 8 ongoing requests each" in out
    assert "note: placement not checked against a cluster (no --address or $RAY_ADDRESS)" in out


def _deployment(**options: Any) -> Any:
    return lambda a: a["deployments"][0].update(options)


@pytest.mark.parametrize(("edit", "says"), [
    (_deployment(autoscaling_config={"max_replicas": 0}),
     "deployments[DSDEServer]: autoscaling_config: max_replicas: Input should be greater than 0"),
    (_deployment(autoscaling_config={"max_replicas": 2, "target_ongoing_requests": 300}),
     "deployments[DSDEServer]: autoscaling_config: target_ongoing_requests 300 is above max_batch_size + max_queue"),
    (_deployment(autoscaling_config={"max_replicas": 2, "target_ongoing_requests": 50}, max_ongoing_requests=40),
     "target_ongoing_requests 50 is above max_ongoing_requests (40)"),
    (_deployment(num_replicas=2), "Serve's schema: applications.0.deployments.0: Value error, Manually setting "
                                  "num_replicas is not allowed when autoscaling_config is provided"),
    (lambda a: a["args"].update(autoscaling_config={"max_replicas": 2, "bogus": 1}),
     "args: autoscaling_config: unknown key(s) bogus"),
    (lambda a: a["args"].update(placement_strategy="SPREAD", draft_num_cpus=0),
     "args: placement_strategy SPREAD gives the draft a bundle"),
    (lambda a: a["args"].update(target_resources={"GPU": 1}), "args: target_resources: 'GPU' is not a custom"),
])
def test_an_autoscaling_or_placement_problem_names_its_field(tmp_path: Path, edit: Any, says: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _edited(edit))
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dsde: error: {path}: ") and says in err, err


def test_a_fixed_replica_count_or_a_deployment_autoscaling_config_is_the_one_that_applies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fixed(app: dict[str, Any]) -> None:
        del app["deployments"][0]["autoscaling_config"]
        app["deployments"][0]["num_replicas"] = 3

    [app] = check_config_file(_write(tmp_path, _edited(fixed)))
    assert app.autoscaling is None and app.num_replicas == 3 and app.describe().endswith("3 replicas")
    # Serve replaces the args' autoscaling_config with the deployment's, whole: its default target, not ours
    path = _write(tmp_path, _edited(_deployment(autoscaling_config={"min_replicas": 1, "max_replicas": 4})))
    [app] = check_config_file(path)
    assert app.autoscaling == {"target_ongoing_requests": 2, "min_replicas": 1, "max_replicas": 4}
    assert main(["check-config", str(path)]) == 0
    assert "has no target_ongoing_requests: Serve's default 2 applies" in capsys.readouterr().out


def test_a_placement_is_described_in_a_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _edited(lambda a: a["args"].update(
        placement_strategy="STRICT_SPREAD", draft_resources={"dsde_draft": 1}, target_num_gpus=1)))
    assert main(["check-config", str(path)]) == 0
    assert ("placement: one STRICT_SPREAD placement group per replica; target {CPU: 1, GPU: 1}, draft "
            "{CPU: 1, dsde_draft: 1}, controller {} (nothing)") in capsys.readouterr().out


def _split(**args: Any) -> ServiceConfig:
    return ServiceConfig(**{"draft_resources": {"dsde_draft": 1}, "target_resources": {"dsde_target": 1},
                            "target_num_gpus": 1, **args})


GPU_NODE = {"CPU": 8.0, "GPU": 1.0, "dsde_target": 1.0}
CPU_NODE = {"CPU": 4.0, "dsde_draft": 2.0}


def test_unplaced_names_the_role_and_the_resource_no_node_has() -> None:
    from services.config_file import unplaced

    assert unplaced(_split(), [GPU_NODE, CPU_NODE]) == []
    assert unplaced(_split(placement_strategy="STRICT_SPREAD"), [GPU_NODE, CPU_NODE]) == []
    assert unplaced(_split(), [GPU_NODE]) == ["the draft asks for dsde_draft 1 (no node has it)"]
    assert unplaced(_split(target_num_gpus=2), [GPU_NODE, CPU_NODE]) == [
        "the target asks for GPU 2 (the most any node has is 1)"]
    assert unplaced(ServiceConfig(draft="none", target_num_cpus=16), [GPU_NODE]) == [
        "the target asks for CPU 16 (the most any node has is 8)"]
    assert unplaced(ServiceConfig(controller_resources={"dsde_head": 1}), [GPU_NODE]) == [
        "the controller asks for dsde_head 1 (no node has it)"]


def test_unplaced_holds_a_placement_group_to_its_strategy() -> None:
    from services.config_file import unplaced

    both = {"CPU": 8.0, "dsde_draft": 1.0, "dsde_target": 1.0, "GPU": 1.0}  # one node could take either
    # STRICT_SPREAD needs two nodes for the two bundles
    [problem] = unplaced(_split(placement_strategy="STRICT_SPREAD"), [both])
    assert problem.startswith("placement_strategy STRICT_SPREAD puts the target and draft on different nodes, and no "
                              "2 nodes of the cluster hold them")
    assert unplaced(_split(placement_strategy="STRICT_SPREAD"), [both, CPU_NODE]) == []
    assert unplaced(_split(placement_strategy="STRICT_PACK"), [both]) == []
    # STRICT_PACK needs one node with the sum
    [problem] = unplaced(_split(placement_strategy="STRICT_PACK"), [GPU_NODE, CPU_NODE])
    assert problem == ("placement_strategy STRICT_PACK puts the target and draft on one node: no node has {CPU: 2, "
                       "GPU: 1, dsde_target: 1, dsde_draft: 1} on one node, and each lacks some (node 0 lacks "
                       "dsde_draft 1; node 1 lacks GPU 1, dsde_target 1)"), problem
    # PACK and SPREAD may share a node, within its capacity
    roomy = {"CPU": 1.0, "dsde_draft": 1.0, "dsde_target": 1.0, "GPU": 1.0}
    [problem] = unplaced(_split(placement_strategy="PACK"), [roomy])  # two bundles of 1 CPU on a 1-CPU node
    assert problem.startswith("placement_strategy PACK puts the target and draft on nodes, and no 2 nodes")
    assert unplaced(_split(placement_strategy="PACK"), [{**roomy, "CPU": 2.0}]) == []


def test_check_config_with_an_address_it_cannot_reach_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.service_support import free_port

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["check-config", str(DEPLOY), "--address", address]) == 2
    assert f"dsde: error: cannot reach the Ray cluster at {address}: " in capsys.readouterr().err
    monkeypatch.setenv("RAY_ADDRESS", address)  # the same from the environment
    assert main(["check-config", str(DEPLOY)]) == 2
    assert f"cannot reach the Ray cluster at {address}" in capsys.readouterr().err
