"""The service's pieces without a Ray cluster: configs, the policy controller (in-process, under dsde_core's own
engine), request validation, response shapes, and the metrics table of docs/operations.md."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dsde_core.config import SamplingParams
from dsde_core.errors import ConfigError
from dsde_core.policies import CappedPolicy, DSDEPolicy, GoodputPolicy, SeqInfo, StaticPolicy
from dsde_core.request import RequestOutput, RequestStats
from dsde_core.sampling import TokenLogprob
from services.completion_bodies import Reply
from services.config import PolicyConfig, ServiceConfig, build_policy
from services.controller import Controller
from services.ingress import choice_params, merge
from services.metrics import METRICS, exported_name
from services.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    describe_invalid,
    error_body,
)
from tests.cli_support import help_flags
from tests.tiny import random_prompts, tiny_engine

ROOT = Path(__file__).resolve().parents[1]


# ---- configs ----------------------------------------------------------------------------------------
def test_service_config_defaults_and_errors() -> None:
    cfg = ServiceConfig()
    assert cfg.draft and cfg.target and cfg.served_name == cfg.target
    assert cfg.engine_config().prefill_chunk == 4096  # chunked prefill reaches the ingress's engine; null: no limit
    assert ServiceConfig.from_args({"prefill_chunk": None}).engine_config().prefill_chunk is None
    assert ServiceConfig(target="/models/my-model/", draft="none").served_name == "my-model"
    assert ServiceConfig(draft="none").draft is None
    assert ServiceConfig(draft="none", device="cuda:1", target_num_gpus=0.5).device == "cuda:1"  # none for a draft
    for bad, word in [({"max_batch_size": 0}, "max_batch_size"), ({"dtype": "int8"}, "dtype"),
                      ({"policy": "bogus"}, "bogus"), ({"target_num_gpus": -1}, "target_num_gpus"),
                      ({"device": "tpu"}, "device"), ({"device": "cuda:x"}, "device"), ({"nonsense": 1}, "nonsense"),
                      ({"device": "cuda", "target_num_gpus": 1}, "draft_num_gpus"),
                      ({"admit_wait_s": -0.1}, "admit_wait_s"), ({"admit_wait_s": "soon"}, "admit_wait_s"),
                      ({"draft_window": 0}, "draft_window"), ({"draft_window": -1}, "draft_window"),
                      ({"prefill_chunk": 0}, "prefill_chunk")]:
        with pytest.raises(ConfigError, match=word):
            ServiceConfig.from_args(bad)


def test_serve_run_key_value_args_are_read_as_their_fields_types() -> None:
    """`serve run services.app:build_app max_batch_size=4 ...` hands every argument over as a string (Ray's own
    convert_args_to_dict below); a field that takes no string reads it as YAML reads a scalar. Before, any numeric
    argument failed ("'<=' not supported between instances of 'int' and 'str'")."""
    from ray.serve.scripts import convert_args_to_dict

    args = convert_args_to_dict(("max_batch_size=4", "draft_num_gpus=0.5", "request_timeout_s=30", "draft=none",
                                 "draft_window=null", "policy=static:3", "api_key=12345"))
    assert set(map(type, args.values())) == {str}
    cfg = ServiceConfig.from_args(args)
    assert (cfg.max_batch_size, cfg.draft_num_gpus, cfg.request_timeout_s) == (4, 0.5, 30)
    assert (cfg.draft, cfg.draft_window, cfg.policy, cfg.api_key) == (None, None, "static:3", "12345")  # str stays
    live = PolicyConfig.from_dict({"policy": "dsde", "params": "{c: 0.5}", "cap": "false", "max_sl": "6"})
    assert (live.params, live.cap, live.max_sl) == ({"c": 0.5}, False, 6)
    for bad, says in ((("max_batch_size=many",), "app args: max_batch_size takes int, got 'many'"),
                      (("request_timeout_s=soon",), "request_timeout_s takes float or null, got 'soon'")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            ServiceConfig.from_args(convert_args_to_dict(bad))


def test_placement_args_reserve_nothing_by_default_and_a_bundle_per_actor_with_a_strategy() -> None:
    """No placement args: no group, each actor asks only for its CPUs/GPUs, as before. With placement_strategy each
    model host gets a bundle holding exactly what it asks for; the controller only when it asks for something (a
    bundle cannot be empty). `serve run` hands the args over as strings, read as the config file would."""
    from ray.serve.scripts import convert_args_to_dict

    cfg = ServiceConfig()
    assert cfg.placement_strategy is None and cfg.bundles() == {}
    assert (cfg.resources("draft"), cfg.resources("target"), cfg.resources("controller")) == ({"CPU": 1.0},
                                                                                               {"CPU": 1.0}, {})
    split = ServiceConfig.from_args(convert_args_to_dict((
        "placement_strategy=strict_spread", "draft_resources={dsde_draft: 1}", "target_resources={dsde_target: 1}",
        "target_num_gpus=1", "draft_num_cpus=2")))
    assert split.placement_strategy == "STRICT_SPREAD"
    assert split.bundles() == {"target": {"CPU": 1.0, "GPU": 1.0, "dsde_target": 1.0},
                               "draft": {"CPU": 2.0, "dsde_draft": 1.0}}
    assert list(ServiceConfig(placement_strategy="PACK", controller_resources={"head": 0.01}).bundles()) == [
        "target", "draft", "controller"]
    assert list(ServiceConfig(draft="none", placement_strategy="PACK").bundles()) == ["target"]
    assert ServiceConfig(placement_strategy="none", draft_resources=None).placement_strategy is None
    for bad, says in [({"placement_strategy": "SPREAD_OUT"}, "placement_strategy must be one of PACK, SPREAD"),
                      ({"draft_resources": {"CPU": 1}}, "draft_resources: 'CPU' is not a custom resource"),
                      ({"target_resources": {"GPU": 1}}, "target_resources: 'GPU' is not a custom resource"),
                      ({"controller_resources": {"a b": 1}}, "controller_resources: a resource name"),
                      ({"draft_resources": {"x": 0}}, "draft_resources: x must be an amount in (0, 1e6]"),
                      ({"draft_resources": {"x": True}}, "draft_resources: x must be an amount"),
                      ({"target_resources": [1]}, "target_resources must be a mapping"),
                      ({"placement_timeout_s": 0}, "placement_timeout_s must be in (0, 86400]"),
                      ({"placement_strategy": "PACK", "target_num_cpus": 0},
                       "placement_strategy PACK gives the target a bundle of the replica's placement group, but it "
                       "asks for no resource")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            ServiceConfig.from_args(bad)


def test_each_actor_is_created_with_its_resources_and_in_its_bundle() -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.placement import _options

    plain = _options(ServiceConfig(draft_resources={"dsde_draft": 1}), "draft", "dsde-draft-x", None, {})
    assert plain == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {"dsde_draft": 1.0}, "max_restarts": 3,
                     "max_task_retries": 0, "name": "dsde-draft-x"}
    cfg = ServiceConfig(placement_strategy="SPREAD", target_resources={"dsde_target": 1})
    group = PlacementGroup(PlacementGroupID.from_random())
    bundles = {role: i for i, role in enumerate(cfg.bundles())}
    target = _options(cfg, "target", "t", group, bundles)
    strategy = target["scheduling_strategy"]
    assert isinstance(strategy, PlacementGroupSchedulingStrategy) and strategy.placement_group is group
    assert strategy.placement_group_bundle_index == 0 and target["resources"] == {"dsde_target": 1.0}
    assert _options(cfg, "draft", "d", group, bundles)["scheduling_strategy"].placement_group_bundle_index == 1
    assert "scheduling_strategy" not in _options(cfg, "controller", "c", group, bundles)  # asks nothing: no bundle


def test_build_app_takes_an_autoscaling_config_and_never_sets_num_replicas() -> None:
    from services.app import build_app

    base = {"draft": "none", "max_batch_size": 4}
    fixed = build_app(base)._bound_deployment._deployment_config
    assert "num_replicas" not in fixed.user_configured_option_names and fixed.autoscaling_config is None
    scaled = build_app({**base, "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    config = scaled._bound_deployment._deployment_config
    assert "num_replicas" not in config.user_configured_option_names
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (1, 3)
    assert config.autoscaling_config.target_ongoing_requests == 4  # max_batch_size, unless given
    given = build_app({**base, "autoscaling_config": "{max_replicas: 2, target_ongoing_requests: 6}"})  # serve run
    assert given._bound_deployment._deployment_config.autoscaling_config.target_ongoing_requests == 6
    for bad, says in [({"max_replicas": 0}, "autoscaling_config: max_replicas: Input should be greater than 0"),
                      ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) must be greater than or equal"),
                      ({"max_replica": 2}, "autoscaling_config: unknown key(s) max_replica; valid: min_replicas"),
                      ({"target_ongoing_requests": 100}, "target_ongoing_requests 100 is above max_batch_size + "
                                                         "max_queue (68)"),
                      ([2], "autoscaling_config must be a mapping")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            build_app({**base, "autoscaling_config": bad})


def test_the_per_replica_load_signals_carry_the_replica() -> None:
    from services.metrics import ServiceMetrics

    metrics = ServiceMetrics("tiny", "r1", max_batch_size=4)
    metrics.on_load(running=3, waiting=5, slots_in_use=3)
    assert metrics._gauges[("dsde_kv_cache_usage_perc", (("replica", "r1"),))] == 0.75
    assert metrics._gauges[("dsde_replica_num_requests_waiting", (("replica", "r1"),))] == 5
    assert metrics._gauges[("dsde_num_requests_waiting", ())] == 5  # the model-wide series, as before


def test_draft_window_reaches_the_engine_config_and_the_draft_host(save_tiny_model) -> None:
    """Off by default; an app arg draft_window reaches the ingress's engine (which prices the draft's prefill with it)
    and the DraftHost's worker (which windows its cache) alike."""
    import torch

    from services.actors import DraftHost

    assert ServiceConfig().draft_window is None and ServiceConfig().engine_config().draft_window is None
    cfg = ServiceConfig.from_args({"draft_window": 6})
    assert cfg.engine_config().draft_window == 6
    host = DraftHost(str(save_tiny_model("draft")), "float32", "cpu", 2, 64, num_threads=torch.get_num_threads(),
                     window=cfg.draft_window)
    assert host.worker.window == 6
    assert DraftHost(str(save_tiny_model("plain")), "float32", "cpu", 2, 64,
                     num_threads=torch.get_num_threads()).worker.window is None


def test_policy_config_builds_policies_with_params_and_cap() -> None:
    assert isinstance(build_policy(PolicyConfig()), GoodputPolicy)  # the default
    p = build_policy(PolicyConfig(policy="dsde"))
    assert isinstance(p, CappedPolicy) and isinstance(p.inner, DSDEPolicy)
    assert not isinstance(build_policy(PolicyConfig(policy="dsde", cap=False)), CappedPolicy)
    assert isinstance(build_policy(PolicyConfig(policy="dsde-nocap", cap=True)), CappedPolicy)
    p = build_policy(PolicyConfig(policy="dsde", params={"c": 0.25, "min_spec": 3}))
    assert p.inner.config.c == 0.25 and p.inner.config.min_spec == 3 and p.inner.config.min_sl == 3
    assert build_policy(PolicyConfig(policy="dsde-paper", params={"window": 12})).inner.config.delta == 0.85
    p = build_policy(PolicyConfig(policy="static:3"))
    assert isinstance(p, StaticPolicy) and p.config.k == 3
    assert build_policy(PolicyConfig(policy="static:3", params={"k": 6})).config.k == 6
    for bad, word in [({"policy": "off", "params": {"k": 1}}, "takes no params"),
                      ({"policy": "dsde", "params": {"bogus": 1}}, "bogus"),
                      ({"policy": "dsde", "params": {"delta": 7}}, "delta"),
                      ({"policy": "nope"}, "nope"), ({"max_sl": 99}, "max_sl"), ({"cap": "yes"}, "cap"),
                      ({"polcy": "dsde"}, "polcy")]:
        with pytest.raises(ConfigError, match=word):
            PolicyConfig.from_dict(bad)


# ---- the controller --------------------------------------------------------------------------------
def test_controller_under_the_engine_is_lossless_and_frees_everything() -> None:
    """The controller is a full policy: dsde_core's engine runs it in-process exactly like a local policy."""
    prompts = random_prompts(6, seed=5)
    reference = tiny_engine("off", batch=1, with_draft=False)
    ref = []
    for p in prompts:
        r = reference.add_request(p, SamplingParams(max_tokens=20))
        reference.run()
        ref.append(r.output_ids)
    engine = tiny_engine(Controller(PolicyConfig(policy="dsde")), batch=3)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in prompts]
    engine.run()
    assert [r.output_ids for r in reqs] == ref
    assert sum(r.stats.drafted for r in reqs) > 0
    assert engine.policy.num_tracked() == 0 and engine.policy.describe()["generations"] == 1


def test_controller_reconfigure_applies_to_later_requests_only() -> None:
    engine = tiny_engine(Controller(PolicyConfig(policy="static:4")), batch=4)
    ctrl: Controller = engine.policy
    prompts = random_prompts(3, seed=9)
    early = engine.add_request(prompts[0], SamplingParams(max_tokens=30))
    engine.step()  # `early` is bound to generation 0 (static:4)
    ctrl.reconfigure(PolicyConfig(policy="off"))
    late = engine.add_request(prompts[1], SamplingParams(max_tokens=30))
    engine.run()
    assert early.stats.drafted > 0 and max(early.stats.sl) == 4
    assert late.stats.drafted == 0
    assert ctrl.describe()["generations"] == 1 and ctrl.num_tracked() == 0  # the old generation was dropped
    ctrl.reconfigure(PolicyConfig(policy="static:5", max_sl=2))
    capped = engine.add_request(prompts[2], SamplingParams(max_tokens=30))
    engine.run()
    assert max(capped.stats.sl) == 2


def test_controller_telemetry_reports_cap_and_wvir() -> None:
    ctrl = Controller(PolicyConfig(policy="dsde"))
    engine = tiny_engine(ctrl, batch=2)
    seen = []
    original = ctrl.observe
    ctrl.observe = lambda fb: seen.append(original(fb)) or seen[-1]
    for p in random_prompts(2, seed=4):
        engine.add_request(p, SamplingParams(max_tokens=80))
    engine.run()
    assert any(t.wvir for t in seen)  # after warm-up (30 KLDs) DSDE has a WVIR per step
    assert any(t.cap is not None for t in seen)
    assert all(t.policy == "dsde" for t in seen)


def test_controller_plans_respect_max_k() -> None:
    ctrl = Controller(PolicyConfig(policy="static:6"))
    plans = ctrl.plan([SeqInfo("a", 0.0, 2), SeqInfo("b", 0.0, 9)])
    assert [p.k for p in plans] == [2, 6]


# ---- transport ------------------------------------------------------------------------------------------
def test_packed_proposals_carry_exactly_the_same_values() -> None:
    import torch

    from dsde_core.workers import DraftTask
    from services.transport import pack, unpack

    engine = tiny_engine("static:4", batch=2)
    for slot in range(2):
        engine.draft.open(slot, SamplingParams(temperature=0.7, seed=slot))
        engine.target.open(slot, SamplingParams(temperature=0.7, seed=slot))
    # min_confidence 0: never stops early, but makes the draft compute the entropy that crosses too
    props = engine.draft.propose([DraftTask(0, random_prompts(1, seed=2)[0], 4, 0.0), DraftTask(1, [5, 6], 0)])
    for p in props:
        q = unpack(pack(p))
        assert q.slot == p.slot and q.tokens == p.tokens and len(q.dists) == len(p.dists)
        for a, b in zip(p.dists, q.dists, strict=True):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.q_sample, b.q_sample)
            assert torch.equal(a.q_signal, b.q_signal) and a.entropy == b.entropy
    assert props[0].dists and not props[1].dists


# ---- protocol ---------------------------------------------------------------------------------------
def test_request_models_bound_their_fields() -> None:
    ok = CompletionRequest(model="m", prompt="hi", temperature=0, stop="x", top_k=-1)
    assert ok.sampling(5) == SamplingParams(max_tokens=5, temperature=0.0, stop=("x",))
    assert CompletionRequest(model="m", prompt=["only one"]).prompts() == ["only one"]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(model="m", prompt=[[1, 2, 3]]).prompts() == [[1, 2, 3]]
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                 max_completion_tokens=7)
    assert chat.max_tokens == 7 and chat.chat() == [{"role": "user", "content": "a"}]
    for bad in [dict(n=0), dict(n=17), dict(temperature=2.5), dict(top_p=0), dict(max_tokens=0),
                dict(prompt=["a"] * 65), dict(prompt=["a", [1]]),
                dict(logprobs=21), dict(logprobs=-1), dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                dict(repetition_penalty=0.009), dict(repetition_penalty=10.5), dict(speculation={"max_sl": 65}),
                dict(speculation={"policy": "x"}), dict(stop=[""]), dict(seed=-1), dict(suffix="x"),
                dict(best_of=2), dict(response_format={"type": "json_object"}), dict(guided_regex="a+"),
                dict(structured_outputs={"choice": ["a"]})]:
        with pytest.raises(ValidationError):
            CompletionRequest(**{"model": "m", "prompt": "hi", **bad})
    assert CompletionRequest(model="m", prompt="hi", logprobs=0).sampling(5).logprobs == 0
    assert CompletionRequest(model="m", prompt="hi").sampling(5).logprobs is None
    assert CompletionRequest(model="m", prompt="hi", echo=True, logprobs=2).sampling(5).prompt_logprobs == 2
    assert CompletionRequest(model="m", prompt="hi", echo=True).sampling(5).prompt_logprobs is None
    assert CompletionRequest(model="m", prompt="hi", logprobs=2).sampling(5).prompt_logprobs is None
    penalized = CompletionRequest(model="m", prompt="hi", presence_penalty=-2, frequency_penalty=0.5,
                                  repetition_penalty=1.3).sampling(5)
    assert (penalized.presence_penalty, penalized.frequency_penalty, penalized.repetition_penalty) == (-2, 0.5, 1.3)
    user = [{"role": "user", "content": "x"}]
    assert ChatCompletionRequest(model="m", messages=user, logprobs=True, top_logprobs=5).sampling(5).logprobs == 5
    assert ChatCompletionRequest(model="m", messages=user, logprobs=True).sampling(5).logprobs == 0
    assert ChatCompletionRequest(model="m", messages=user, top_logprobs=0).sampling(5).logprobs is None
    for bad in [dict(top_logprobs=2), dict(logprobs=True, top_logprobs=21), dict(logprobs=3), dict(tools=[{}]),
                dict(functions=[{}]), dict(response_format={"type": "json_schema"}), dict(continue_final_message=True)]:
        with pytest.raises(ValidationError):
            ChatCompletionRequest(model="m", messages=user, **bad)
    assert ChatCompletionRequest(model="m", messages=user, tools=[], response_format={"type": "text"}).tools == []
    prefill = ChatCompletionRequest(model="m", messages=[*user, {"role": "assistant", "content": "So"}],
                                    continue_final_message=True, add_generation_prompt=False)
    assert prefill.template_options() == {"add_generation_prompt": False, "continue_final_message": True}
    assert CompletionRequest(model="m", prompt="hi", n=2, best_of=2, suffix="").best_of == 2  # neutral: accepted
    neutral = CompletionRequest(model="m", prompt="hi", guided_json=None, response_format={})
    assert neutral.response_format == {} and neutral.sampling(5).max_tokens == 5
    with pytest.raises(ValidationError, match="guided_json, guided_grammar \\(structured output\\) is not supported"):
        ChatCompletionRequest(model="m", messages=user, guided_json={}, guided_grammar="root ::= x")
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize(("body", "param"), [
    (dict(prompt="hi", suffix="x"), "suffix"), (dict(prompt="hi", best_of=2), "best_of"),
    (dict(prompt=["a"] * 65), "prompt"), (dict(prompt="hi", structural_tag={}, guided_json={}), "guided_json"),
    (dict(prompt="hi", response_format={"type": "json_object"}), "response_format"),
    (dict(messages=[{"role": "user", "content": "x"}], functions=[{}]), "functions"),
    (dict(messages=[{"role": "user", "content": "x"}], continue_final_message=True), "continue_final_message"),
    (dict(prompt="hi", stream_options={"include_usage": True}), "stream_options"),
    (dict(messages=[{"role": "user", "content": "x"}], stream=False, stream_options={}), "stream_options"),
])
def test_a_model_validators_refusal_names_its_field_as_param(body: dict, param: str) -> None:
    """pydantic gives a model validator's error no location; the error body's `param` still names the field."""
    with pytest.raises(ValidationError) as e:
        (ChatCompletionRequest if "messages" in body else CompletionRequest)(model="m", **body)
    message, named = describe_invalid(e.value.errors())
    assert named == param and param in message, (message, named)


def test_a_mappings_key_at_fault_is_named_by_the_mapping() -> None:
    """pydantic locates a dict key's error at (field, key, "[key]"); the message names the key, `param` the field."""
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt="hi", logit_bias={"x": 1})
    assert describe_invalid(e.value.errors()) == (
        "logit_bias: key 'x': Input should be a valid integer, unable to parse string as an integer", "logit_bias")
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt="hi", logit_bias={"5": "much"})  # a value: its own location
    assert describe_invalid(e.value.errors())[1] == "logit_bias.5"
    assert CompletionRequest(model="m", prompt="hi", logit_bias={"5": 1}).logit_bias == {5: 1.0}  # JSON's keys


@pytest.mark.parametrize(("cls", "body", "says"), [
    (CompletionRequest, dict(prompt="hi", logprobs=True), "logprobs: expected an integer, got true"),
    (CompletionRequest, dict(prompt="hi", echo=1), "echo: expected true or false, got 1"),
    (ResponsesRequest, dict(input="hi", store="no"), "store: expected true or false, got a string"),
    (ResponsesRequest, dict(input="hi", max_output_tokens="9"), "max_output_tokens: expected an integer, got a string"),
    (TokenizeRequest, dict(prompt="x", add_special_tokens=0), "add_special_tokens: expected true or false, got 0"),
    (DetokenizeRequest, dict(tokens=[1, "2"]), "tokens.1: expected an integer, got a string"),
])
def test_every_body_takes_json_types_as_sent(cls: type, body: dict[str, Any], says: str) -> None:
    """No endpoint's body coerces a value into another type (pydantic's lax mode read `true` as 1 max_tokens)."""
    with pytest.raises(ValidationError) as e:
        cls(model="m", **body)
    assert describe_invalid(e.value.errors()) == (says, says.split(":")[0])


BAD_BODIES = [  # (raw body, Content-Type, what the message must say, param)
    (b"{", "application/json", "not valid JSON (Expecting property name enclosed in double quotes at character 1)",
     None),
    (b'{"model": "m", "messages": [],}', "application/json", "at character 30", None),
    (b"", "application/json", "the request body is empty", None),
    (b"", "", "the request body is empty", None),
    (b"[]", "application/json", "must be a JSON object, got an array", None),
    (b'"x"', "application/json; charset=utf-8", "must be a JSON object, got a string", None),
    (b"null", "application/json", "must be a JSON object, got null", None),
    (b"{}", "application/x-www-form-urlencoded",  # curl -d without -H: the body is never read as JSON
     "send it with Content-Type: application/json (got application/x-www-form-urlencoded)", None),
    (b"{}", "", "send it with Content-Type: application/json (got none)", None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "application/json",
     "tools and functions (function calling) are not supported", "tools"),  # a model validator's: its own words
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "application/json",
     "top_logprobs needs logprobs set to true", "top_logprobs"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}',
     "application/json", "response_format 'json_object' is not supported", "response_format"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "application/json",
     "messages.0.content: expected a string or a list of text parts", "messages.0.content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "application/json", "content parts of type \'image_url\' are not supported: this model takes text only",
     "messages.0.content"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 5}', "application/json",
     "stop: expected a string or a list of strings", "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "application/json",
     "model: Field required; temperature: Input should be less than or equal to 2", "model"),
    # JSON's types as sent: nothing coerced into another (true is no 1, "0.5" no number), the type sent named
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "application/json",
     "max_tokens: expected an integer, got true", "max_tokens"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}', "application/json",
     "temperature: expected a number, got a string", "temperature"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2.5}', "application/json",
     "n: expected an integer, got 2.5", "n"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "application/json",
     "stream: expected true or false, got a string", "stream"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "speculation": {"enabled": 0}}',
     "application/json", "speculation.enabled: expected true or false, got 0", "speculation.enabled"),
    (b'{"model": "m", "messages": ["x"]}', "application/json", "messages.0: expected an object, got a string",
     "messages.0"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "speculation": "off"}', "application/json",
     "speculation: expected an object, got a string", "speculation"),
]


@pytest.mark.parametrize(("raw", "content_type", "says", "param"), BAD_BODIES)
def test_a_bad_body_gets_one_message_saying_what_is_wrong(raw: bytes, content_type: str, says: str,
                                                          param: str | None) -> None:
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.testclient import TestClient

    from services import ingress

    app = FastAPI()  # the ingress's handler in front of a route that takes the chat body
    app.add_exception_handler(RequestValidationError, ingress._validation_error)

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, str]:
        return {"model": body.model}

    r = TestClient(app).post("/chat", content=raw, headers={"content-type": content_type} if content_type else {})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", error
    assert says in error["message"] and error["param"] == param, error
    assert "Input should be a valid dictionary" not in error["message"]
    ok = TestClient(app).post("/chat", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200 and ok.json() == {"model": "m"}


def test_a_union_field_names_what_it_takes_in_one_error() -> None:
    for bad, says in [(dict(prompt=5), "a string, a list of strings, a list of token ids or a list of token-id lists"),
                      (dict(prompt=[1.5]), "a list of token ids"), (dict(prompt="x", stop=[1]), "a list of strings")]:
        with pytest.raises(ValidationError) as e:
            CompletionRequest(model="m", **bad)
        assert e.value.error_count() == 1 and says in str(e.value)
    with pytest.raises(ValidationError, match="stop must be at most"):  # a member's own check still speaks
        CompletionRequest(model="m", prompt="x", stop=["a", ""])
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": text}]).chat()[0]["content"] == "ab"


def test_a_number_without_a_fraction_is_an_integer_and_a_fraction_or_a_boolean_is_not() -> None:
    """JSON Schema's `integer` (what the OpenAPI schema states) takes 12.0: a client's float arithmetic writes it so.
    Every integer field of every body takes it as the integer; 12.5, true and "12" stay refused."""
    user = [{"role": "user", "content": "x"}]
    c = CompletionRequest(model="m", prompt=[5.0, 7], max_tokens=12.0, n=2.0, best_of=2.0, top_k=-1.0, seed=3.0,
                          min_tokens=1.0, stop_token_ids=[9.0], logprobs=2.0, speculation={"max_sl": 4.0})
    assert (c.prompt, c.max_tokens, c.n, c.top_k, c.seed, c.min_tokens) == ([5, 7], 12, 2, -1, 3, 1)
    assert (c.stop_token_ids, c.logprobs, c.speculation.max_sl) == ([9], 2, 4)
    assert all(type(v) is int for v in (*c.prompt, c.max_tokens, c.n, c.seed, c.speculation.max_sl))
    assert CompletionRequest(model="m", prompt=[[1.0, 2.0], [3]]).prompts() == [[1, 2], [3]]
    assert ChatCompletionRequest(model="m", messages=user, max_completion_tokens=8.0, logprobs=True,
                                 top_logprobs=3.0).max_tokens == 8
    assert ResponsesRequest(model="m", input="x", max_output_tokens=5.0, n=1.0).max_output_tokens == 5
    assert DetokenizeRequest(model="m", tokens=[1.0, 2]).tokens == [1, 2]
    for bad, says in [(dict(max_tokens=12.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
                      (dict(max_tokens="12"), "max_tokens"), (dict(seed=float("inf")), "seed"),
                      (dict(n=float("nan")), "n"), (dict(prompt=[1.5]), "prompt"),
                      (dict(max_tokens=0.0), "max_tokens")]:
        with pytest.raises(ValidationError) as e:
            CompletionRequest(**{"model": "m", "prompt": "x", **bad})
        assert e.value.errors()[0]["loc"][0] == says, (bad, e.value)


def test_unknown_fields_are_ignored_and_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    user = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        CompletionRequest(model="m", prompt="hi", max_tokens=3, guided_json=None)
        ChatCompletionRequest(model="m", messages=user, n=2)
    assert not caplog.records  # known fields, and a null structured-output field, are not "ignored"
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        req = ChatCompletionRequest(model="m", messages=user, user="u1", max_token=9)
    assert req.max_tokens is None  # the misspelt field did nothing
    assert [r.getMessage() for r in caplog.records] == [
        "The request's fields max_token, user are not known and were ignored"]


def _last(finish_reason: str, stats: RequestStats | None = None, stop_reason: int | str | None = None
          ) -> RequestOutput:
    """A choice's finished output."""
    return RequestOutput("r", [], "", True, finish_reason, stats=stats, stop_reason=stop_reason)


def test_response_shapes() -> None:
    reply = Reply("m", chat=True, prompt_tokens=3)
    reply.record(RequestOutput(reply.id, [5, 6], "hi"))
    body = reply.body([("hi", _last("stop"))])
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert reply.chunk("", role=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error_body("bad", 400)["error"] == {"message": "bad", "type": "invalid_request_error", "code": 400,
                                               "param": None}


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk() -> None:
    """vLLM's stream_options.continuous_usage_stats: only with include_usage; then each chunk carries the usage of the
    tokens recorded so far (the prompt counted once), the role chunk none of the completion's."""
    asks = [({"include_usage": True, "continuous_usage_stats": True}, True),
            ({"continuous_usage_stats": True}, False), ({"include_usage": True}, False), (None, False)]
    for options, continuous in asks:
        body = CompletionRequest(model="m", prompt="x", stream=True, stream_options=options)
        assert body.continuous_usage is continuous
    reply = Reply("m", chat=True, prompt_tokens=3, n=2, continuous_usage=True)
    assert reply.chunk("", role=True)["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    reply.record(RequestOutput(reply.request_id(0), [5, 6], "hi"), 0)
    reply.record(RequestOutput(reply.request_id(1), [7], "yo"), 1)
    assert reply.chunk("yo", index=1)["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert "usage" not in Reply("m", chat=True, prompt_tokens=3).chunk("hi")


def test_log_probabilities_in_openais_two_shapes() -> None:
    """Completions: tokens, token_logprobs, top_logprobs, text_offset (continued across chunks); chat: content
    entries with bytes; a chunk carries what was recorded since the last one; none without the ask."""
    decode = {1: "ab", 2: "c", 3: "é"}.__getitem__
    outs = [RequestOutput("r", [1, 2], "abc", logprobs=[TokenLogprob(-0.1, ((1, -0.1), (3, -2.0))),
                                                         TokenLogprob(-0.5, ((2, -0.5), (1, -1.5)))]),
            RequestOutput("r", [3], "é", True, "length", logprobs=[TokenLogprob(-0.25, ((3, -0.25), (2, -3.0)))])]
    reply = Reply("m", chat=False, prompt_tokens=1, decode=decode)
    reply.record(outs[0])
    first = reply.chunk("abc")["choices"][0]["logprobs"]
    assert first == {"tokens": ["ab", "c"], "token_logprobs": [-0.1, -0.5], "text_offset": [0, 2],
                     "top_logprobs": [{"ab": -0.1, "é": -2.0}, {"c": -0.5, "ab": -1.5}]}
    reply.record(outs[1])
    assert reply.chunk("é", _last("length"))["choices"][0]["logprobs"]["text_offset"] == [3]
    assert reply.chunk("", _last("length"))["choices"][0]["logprobs"]["tokens"] == []  # sent once
    chat = Reply("m", chat=True, prompt_tokens=1, decode=decode)
    for out in outs:
        chat.record(out)
    content = chat.body([("abcé", _last("length"))])["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["ab", "c", "é"] and content[2]["bytes"] == [0xC3, 0xA9]
    assert content[0]["top_logprobs"] == [{"token": "ab", "logprob": -0.1, "bytes": [97, 98]},
                                          {"token": "é", "logprob": -2.0, "bytes": [0xC3, 0xA9]}]
    assert chat.usage()["completion_tokens"] == 3 and chat.chunk("", role=True)["choices"][0]["logprobs"] is None
    own = Reply("m", chat=True, prompt_tokens=1, decode=decode, raw={1: b"ab", 2: b"\xc3", 3: b"\xa9"}.__getitem__)
    own.record(outs[1])
    [entry] = own.body([("é", _last("length"))])["choices"][0]["logprobs"]["content"]
    assert entry["bytes"] == [0xA9] and [e["bytes"] for e in entry["top_logprobs"]] == [[0xA9], [0xC3]]
    plain = Reply("m", chat=False, prompt_tokens=1)
    plain.record(outs[0])
    assert plain.body([("abc", _last("length"))])["choices"][0]["logprobs"] is None


def test_an_echo_starts_the_text_and_the_log_probabilities_with_the_prompts() -> None:
    """The first prompt token has no log-probability (null, as OpenAI's); text offsets count from the echo's start."""
    decode = {7: "Hi", 8: " there", 1: "ab"}.__getitem__
    first = RequestOutput("r", [1], "ab", True, "length", logprobs=[TokenLogprob(-0.1, ((1, -0.1),))],
                          prompt_logprobs=[TokenLogprob(-2.5, ((1, -1.0),))])
    reply = Reply("m", chat=False, prompt_tokens=2, decode=decode, echoes=["Hi there"], prompt_ids=[[7, 8]])
    reply.record(first)
    choice = reply.body([("ab", _last("length"))])["choices"][0]
    assert choice["text"] == "Hi thereab" and reply.usage()["completion_tokens"] == 1
    assert choice["logprobs"] == {"tokens": ["Hi", " there", "ab"], "token_logprobs": [None, -2.5, -0.1],
                                  "top_logprobs": [None, {"ab": -1.0}, {"ab": -0.1}], "text_offset": [0, 2, 8]}
    bare = Reply("m", chat=False, prompt_tokens=2, echoes=["Hi there"])
    bare.record(RequestOutput("r", [1], "ab", True, "length"))
    assert bare.body([("ab", _last("length"))])["choices"][0] == {"index": 0, "text": "Hi thereab", "logprobs": None,
                                                                 "finish_reason": "length", "stop_reason": None}


def test_several_prompts_each_with_n_choices_indexed_prompt_major() -> None:
    """OpenAI's order: choice k is prompt k // n's; each echoes its own prompt; usage counts all prompts once."""
    reply = Reply("m", chat=False, prompt_tokens=5, n=2, prompts=2, echoes=["A", "BB"])
    assert [c.echo for c in reply.choices] == ["A", "A", "BB", "BB"]
    assert len({reply.request_id(k) for k in range(4)}) == 4
    for k in range(4):
        reply.record(RequestOutput("x", [k], "t"), k)
    body = reply.body([(str(k), _last("length")) for k in range(4)])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "A0"), (1, "A1"), (2, "BB2"), (3, "BB3")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_n_choices_each_with_its_index_seed_and_tokens_and_the_prompt_counted_once() -> None:
    reply = Reply("m", chat=False, prompt_tokens=4, n=3)
    assert [reply.request_id(i) for i in range(3)] == [f"{reply.id}-{i}" for i in range(3)]
    assert Reply("m", chat=False, prompt_tokens=4).request_id(0).startswith("cmpl-")
    stats = [RequestStats(steps=2, drafted=4, accepted=2, sl=[2, 2]), None,
             RequestStats(steps=3, drafted=0, sl=[0] * 3)]
    for i, tokens in enumerate([[1, 2], [3], [4, 5, 6]]):
        reply.record(RequestOutput("x", tokens, "t"), i)
    body = reply.body([("a", _last("length", stats[0])), ("b", _last("stop", stats[1], "\n")),
                       ("c", _last("stop", stats[2], 42))])
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == [
        (0, "a", "length", None), (1, "b", "stop", "\n"), (2, "c", "stop", 42)]  # vLLM's: the string, the token
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    spec = body["speculation"]  # over all choices
    assert (spec["steps"], spec["drafted"], spec["accepted"], spec["mean_sl"]) == (5, 4, 2, 0.8)
    assert reply.chunk("x", index=2)["choices"][0]["index"] == 2
    end = reply.chunk("", _last("stop", stats[0], 42), index=1)
    assert end["choices"][0]["stop_reason"] == 42 and end["speculation"]["drafted"] == 4
    base = SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    assert [choice_params(base, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(SamplingParams(), 2).seed is None and choice_params(base, 2).max_tokens == 5


def test_merge_interleaves_the_choices_and_closing_it_closes_every_one() -> None:
    import asyncio

    closed: list[int] = []

    async def choice(i: int, n: int) -> AsyncIterator[RequestOutput]:
        try:
            for j in range(n):
                await asyncio.sleep(0.001 * (i + 1))
                yield RequestOutput(f"r{i}", [j], f"{i}.{j}", j == n - 1)
        finally:
            closed.append(i)

    async def run() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        whole = [(i, out.text) async for i, out in merge([choice(0, 3), choice(1, 2)])]
        closed.clear()
        stream, first = merge([choice(0, 50), choice(1, 50)]), []
        async for i, out in stream:
            first.append((i, out.text))
            if len(first) == 3:
                break
        await stream.aclose()
        return whole, first

    whole, first = asyncio.run(run())
    assert sorted(whole) == [(0, "0.0"), (0, "0.1"), (0, "0.2"), (1, "1.0"), (1, "1.1")]
    assert [t for i, t in whole if i == 0] == ["0.0", "0.1", "0.2"]  # each choice in its order
    assert len(first) == 3 and sorted(closed) == [0, 1]  # a client that leaves closes (cancels) both


# ---- the command --------------------------------------------------------------------------------------
def test_two_dsde_serve_share_the_service_discovery_file(tmp_path: Path) -> None:
    """Each adds its own group and takes out only its own: the second to start no longer hides the first from
    Prometheus, nor does its stop leave the first undiscovered; a group whose endpoint no longer answers (a cluster
    that was killed) is dropped at the next start."""
    import json
    import socket

    from services.launch import ServiceDiscovery

    path = tmp_path / "sd.json"
    with socket.socket() as a, socket.socket() as b, socket.socket() as dead:
        for s in (a, b, dead):
            s.bind(("127.0.0.1", 0))
        a.listen()
        b.listen()
        target = {name: f"127.0.0.1:{s.getsockname()[1]}" for name, s in (("a", a), ("b", b), ("dead", dead))}
        path.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [target["dead"]]}]))  # a killed run's
        first = ServiceDiscovery.write(path, [target["a"]])
        second = ServiceDiscovery.write(path, [target["b"]])
        groups = json.loads(path.read_text())
        assert [g["targets"] for g in groups] == [[target["a"]], [target["b"]]]
        assert all(g["labels"] == {"job": "ray"} for g in groups)
        second.remove()
        assert json.loads(path.read_text()) == [{"labels": {"job": "ray"}, "targets": [target["a"]]}]
        first.remove()
        assert not path.exists()
        first.remove()  # twice: nothing to take out, no error


def test_dsde_serve_rejects_bad_arguments_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from dsde_cli.main import main

    assert main(["serve", "--policy", "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err
    assert main(["serve", "--draft-window", "0"]) == 2
    assert "draft_window" in capsys.readouterr().err
    assert main(["serve", "--prometheus-sd", "/no/such/folder/sd.json"]) == 2
    assert "--prometheus-sd '/no/such/folder/sd.json': /no/such/folder is not a writable directory" in \
        capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
    assert "already in use" in capsys.readouterr().err
    # 198.51.100.1 (TEST-NET-2, documentation only) is no address of this machine
    for flags, says in [(["--port", "99999"], "--port must be a port in [1, 65535], got 99999"),
                        (["--metrics-port", "-3"], "--metrics-port must be a port in [1, 65535], got -3"),
                        (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not a host name"),
                        (["--host", "198.51.100.1"], "--host 198.51.100.1: cannot listen on 198.51.100.1:8000"),
                        (["--num-cpus", "1"], "--num-cpus 1: the model actors need 2 of the cluster's logical CPUs"),
                        (["--worker-niceness", "20"], "--worker-niceness must be a nice level in [-20, 19], got 20"),
                        (["--device", "cuda"], "device 'cuda' needs target_num_gpus > 0 (dsde serve: --num-gpus)"),
                        (["--device", "gpu"], "device must be 'auto', 'cpu' or 'cuda[:N]', got 'gpu'"),
                        (["--num-gpus", "64"], "--num-gpus: the model actors need 128 GPUs, and torch sees")]:
        assert main(["serve", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err


def test_every_dsde_serve_flag_reaches_the_service_or_its_cluster() -> None:
    """A flag that parses but never reaches its setting is silently ignored: each of `dsde serve`'s flags, given a
    value other than its default, shows up in the app's ServiceConfig or in the local cluster's LocalServe (and a new
    flag fails this test until it is listed here)."""
    from dsde_cli.main import parser
    from dsde_cli.serve import local_serve
    from services.config import ServiceConfig

    given = {  # flag: (value, "cfg" or "local", field, expected)
        "--draft": ("none", "cfg", "draft", None), "--target": ("/models/t", "cfg", "target", "/models/t"),
        "--model-name": ("m", "cfg", "model_name", "m"), "--policy": ("static:3", "cfg", "policy", "static:3"),
        "--dtype": ("float32", "cfg", "dtype", "float32"), "--device": ("cpu", "cfg", "device", "cpu"),
        "--max-batch-size": ("3", "cfg", "max_batch_size", 3), "--max-seq-len": ("512", "cfg", "max_seq_len", 512),
        "--draft-window": ("128", "cfg", "draft_window", 128), "--prefill-chunk": ("0", "cfg", "prefill_chunk", None),
        "--threads": ("1", "cfg", "num_threads", 1), "--num-gpus": ("0.5", "cfg", "target_num_gpus", 0.5),
        "--api-key": ("k", "cfg", "api_key", "k"), "--max-queue": ("5", "cfg", "max_queue", 5),
        "--request-timeout": ("9", "cfg", "request_timeout_s", 9.0), "--host": ("0.0.0.0", "local", "host", "0.0.0.0"),
        "--port": ("9000", "local", "port", 9000), "--metrics-port": ("0", "local", "metrics_port", None),
        "--prometheus-sd": ("none", "local", "prometheus_sd", None), "--num-cpus": ("3", "local", "num_cpus", 3),
        "--worker-niceness": ("5", "local", "worker_niceness", 5), "--backend": ("torch", "cfg", "backend", "torch"),
        "--draft-backend": ("llama.cpp", "cfg", "draft_backend", "llama.cpp"),
        "--step": ("static", "cfg", "step", "static"),
    }
    flags = help_flags(parser(), "serve")
    assert flags == set(given), flags ^ set(given)
    args = parser().parse_args(["serve", *[x for flag, (value, *_) in given.items() for x in (flag, value)]])
    opts = local_serve(args)
    cfg = ServiceConfig.from_args(opts.args)
    for flag, (_, where, name, expected) in given.items():
        assert getattr(cfg if where == "cfg" else opts, name) == expected, flag
    assert cfg.draft_num_gpus == 0.5  # --num-gpus: each model actor's
    defaults = ServiceConfig.from_args(local_serve(parser().parse_args(["serve", "--prefill-chunk", "256"])).args)
    assert defaults.prefill_chunk == 256 and defaults.api_key is None and defaults.draft_window is None


# ---- documentation ----------------------------------------------------------------------------------
def test_docs_document_every_metric() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `(ray_dsde_[a-z0-9_]+)`", operations, re.M)}
    exported = {exported_name(name, kind) for name, kind, *_ in METRICS}
    assert exported == table, (exported - table, table - exported)


def test_quiet_serve_controller_sets_a_variable_serve_reads_and_keeps_an_operators(monkeypatch) -> None:
    import os
    import subprocess
    import sys

    from services.launch import SERVE_CONTROL_LOOP_ENV, SERVE_CONTROL_LOOP_S, quiet_serve_controller

    monkeypatch.delenv(SERVE_CONTROL_LOOP_ENV, raising=False)
    quiet_serve_controller()
    assert os.environ[SERVE_CONTROL_LOOP_ENV] == SERVE_CONTROL_LOOP_S
    monkeypatch.setenv(SERVE_CONTROL_LOOP_ENV, "0.2")
    quiet_serve_controller()
    assert os.environ[SERVE_CONTROL_LOOP_ENV] == "0.2"
    # the name is the one Ray Serve's controller reads (a rename in Ray would make the setting a silent no-op)
    out = subprocess.run([sys.executable, "-c", "from ray.serve._private import constants as c; "
                          "print(c.CONTROL_LOOP_INTERVAL_S)"], env={**os.environ, SERVE_CONTROL_LOOP_ENV: "0.5"},
                         capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) == 0.5


def test_the_ceiling_note_names_the_policy_that_applies(caplog: pytest.LogCaptureFixture) -> None:
    """Serve calls reconfigure right after the ingress is built: a policy above max_sl in the app args that a
    user_config replaces gets no warning; where none replaces it, the first health check warns, once."""
    import asyncio
    from types import SimpleNamespace

    from services.ingress import DSDEServer

    async def reconfigure(cfg: PolicyConfig) -> str:  # the controller's: the name of the policy now current
        return cfg.describe()

    class Replica(DSDEServer.func_or_class):
        def __del__(self) -> None:  # nothing started, nothing to stop
            pass

    def server(policy: str) -> Replica:
        srv = object.__new__(Replica)  # the state __init__ leaves, without a cluster
        srv.cfg, srv.policy_config, srv.policy = ServiceConfig(policy=policy, max_sl=8), PolicyConfig(policy), policy

        async def describe() -> dict[str, str]:
            return {"policy": srv.policy}

        controller = SimpleNamespace(reconfigure=SimpleNamespace(remote=reconfigure),
                                     describe=SimpleNamespace(remote=describe))
        srv.aengine, srv.actors = SimpleNamespace(alive=True), SimpleNamespace(named=dict, controller=controller)
        return srv

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        replaced = server("static:30")
        asyncio.run(replaced.reconfigure({"policy": "static:4"}))
        asyncio.run(replaced.check_health())
        assert warnings() == []
        alone = server("static:30")
        asyncio.run(alone.check_health())
        asyncio.run(alone.check_health())
        assert len(warnings()) == 1 and warnings()[0].startswith("policy static:30 plans k up to 30")
        asyncio.run(alone.reconfigure({"policy": "static:12"}))
        assert warnings()[1].startswith("policy static:12 plans k up to 12, above the engine's max_sl 8")
