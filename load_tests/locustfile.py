"""Locust load test of DSDE Serve's OpenAI-compatible API (docs/operations.md, Load testing with Locust).

Each simulated user streams chat and text completions (`stream: true`, usage in the last chunk), and with
--responses-fraction the Responses API (its events; usage in the last), with real prompts
from the benchmark workloads (dsde_bench.workloads: ShareGPT, HumanEval, GSM8K, ... from the data packages that
`make setup` installs), mixing short and long generations. Beside Locust's own entry per endpoint (the time until the
response headers, i.e. until the stream opens), every streamed request fires custom request events, the convention
of LLM Locust harnesses, so that they land in the same statistics and CSV files:

    type LLM, name TTFT   time to first token: request sent -> first chunk with text
    type LLM, name ITL    inter-token latency: gap between successive chunks with text (one per engine step that
                          gave the request tokens; with speculative decoding a step can carry several tokens)
    type LLM, name TPOT   time per output token: (last - first chunk) / (completion tokens - 1)
    type LLM, name E2E    end-to-end latency: request sent -> `data: [DONE]` (the Responses API: its
                          response.completed or response.incomplete event)

(response_length of TTFT/E2E/TPOT is the request's completion tokens.) A request fails on an HTTP error, an error
event in the stream (the Responses API: `error` or response.failed), a malformed chunk, or a stream that ends
without `[DONE]` (without its final event).

    .venv/bin/locust -f load_tests/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --users 4 --spawn-rate 2 --run-time 60s --csv results/locust --only-summary

Options (also LOCUST_* environment variables): --model (default: the first of GET /v1/models), --workloads
(chat,code,math), --prompts-per-workload (8), --short-tokens (32), --long-tokens (256), --long-fraction (0.25),
--max-prompt-chars (1500), --responses-fraction (0: share sent to /v1/responses), --chat-fraction (0.5 of the
rest), --temperature (0), --api-key (default $DSDE_API_KEY: sent as a
bearer token to a service started with a key). A bad option ends Locust before the run, in one line; a model list
that does not answer stops the test within seconds.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from typing import Any

import gevent
from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC

from dsde_bench.serve_client import RESPONSE_ENDS, chunk_error, chunk_text, chunk_usage
from dsde_bench.workloads import load_workload
from dsde_core.errors import ConfigError, DSDEError

_PROMPTS: list[str] = []
_MODEL: list[str] = []
_STOPPING: list[bool] = []  # a user found no model list: the test is ending
_LOADED: dict[tuple[str, int, int], list[str]] = {}  # the prompts of each (workloads, per workload, max chars)


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--model", default="", help="served model name (default: the first of GET /v1/models)")
    parser.add_argument("--workloads", default="chat,code,math", help="dsde_bench workloads to draw prompts from")
    parser.add_argument("--prompts-per-workload", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=32, help="max_tokens of a short generation")
    parser.add_argument("--long-tokens", type=int, default=256, help="max_tokens of a long generation")
    parser.add_argument("--long-fraction", type=float, default=0.25, help="share of requests that are long")
    parser.add_argument("--max-prompt-chars", type=int, default=1500, help="longer prompts are not sampled")
    parser.add_argument("--responses-fraction", type=float, default=0.0, help="share sent to /v1/responses")
    parser.add_argument("--chat-fraction", type=float, default=0.5,
                        help="share of the rest sent to /v1/chat/completions (the others: /v1/completions)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default="", env_var="DSDE_API_KEY", is_secret=True,
                        help="sent as 'Authorization: Bearer KEY' (a service started with --api-key)")


def _prompts(opts: Any) -> list[str]:
    """The prompts the options ask for; ConfigError naming the option that cannot be honoured."""
    for ok, problem in ((opts.prompts_per_workload >= 1, "--prompts-per-workload must be >= 1"),
                        (opts.short_tokens >= 1 and opts.long_tokens >= 1, "--short-tokens and --long-tokens must be "
                                                                            ">= 1"),
                        (0 <= opts.long_fraction <= 1, "--long-fraction must be in [0, 1]"),
                        (0 <= opts.chat_fraction <= 1, "--chat-fraction must be in [0, 1]"),
                        (0 <= opts.responses_fraction <= 1, "--responses-fraction must be in [0, 1]"),
                        (0 <= opts.temperature <= 2, "--temperature must be in [0, 2]")):
        if not ok:
            raise ConfigError(problem)
    key = (opts.workloads, opts.prompts_per_workload, opts.max_prompt_chars)
    if key not in _LOADED:  # each test start asks again (the web UI may change the options): load once a choice
        prompts: list[str] = []
        for name in filter(None, (w.strip() for w in opts.workloads.split(","))):
            prompts += [p.text for p in load_workload(name, n=opts.prompts_per_workload, seed=0,
                                                      max_chars=opts.max_prompt_chars)]
        if not prompts:
            raise ConfigError(f"no prompts from --workloads {opts.workloads!r}")
        _LOADED[key] = prompts
    return _LOADED[key]


@events.init.add_listener
def _check_options(environment: Environment, **_: Any) -> None:
    """Bad options end the run before it starts, in one line (not a traceback and a run without prompts)."""
    if environment.parsed_options is not None:
        try:
            _prompts(environment.parsed_options)
        except DSDEError as e:
            sys.exit(f"locustfile: error: {e}")
    # the load above blocked gevent's loop, whose clock stands still until the loop runs again; --run-time's timer,
    # armed next from that clock, would fire early by the load's time (on a busy machine before any user has started)
    gevent.get_hub().loop.update_now()


@events.test_start.add_listener
def _load_prompts(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    _PROMPTS[:] = _prompts(opts)  # again: the web UI may have changed the options
    _MODEL[:] = [opts.model] if opts.model else []


def _read(event: dict[str, Any]) -> tuple[str, int | None, bool, Any]:
    """One parsed event's text, the completion tokens where it states them, whether it ends the stream (the Responses
    API's last event; chat and completions end with `data: [DONE]`, read before this), and the error it reports (None:
    none); read as `dsde bench --url` reads it (dsde_bench.serve_client). A KeyError: a malformed event."""
    error = chunk_error(event)
    if error is not None:
        return "", None, True, error
    usage, _ = chunk_usage(event)
    ends = event.get("type") in RESPONSE_ENDS
    if ends and usage is None:
        raise KeyError("usage")  # the Responses API's last event states the output's tokens
    return chunk_text(event), usage["completion_tokens"] if usage else None, ends, None


class OpenAIStreamingUser(HttpUser):
    """One client: a streamed request, then a short think time."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        if self.environment.parsed_options.api_key:
            self.client.headers["Authorization"] = f"Bearer {self.environment.parsed_options.api_key}"
        if not _MODEL:
            with self.client.get("/v1/models", name="GET /v1/models", catch_response=True) as r:
                if r.status_code != 200 or not r.json().get("data"):
                    # HTTP 0: nothing answered at --host. No user can run: the test ends now, not at --run-time,
                    # once the --csv writer (every CSV_STATS_INTERVAL_SEC) has written this failure
                    r.failure(f"/v1/models: HTTP {r.status_code}: {r.text[:200]}")
                    if not _STOPPING:
                        _STOPPING.append(True)
                        logging.error("no model list at %s/v1/models (HTTP %s): stopping the test", self.host,
                                      r.status_code)
                        gevent.spawn_later(CSV_STATS_INTERVAL_SEC + 1, self.environment.runner.quit)
                    raise StopUser()
                _MODEL[:] = [r.json()["data"][0]["id"]]
        self.rng = random.Random()

    @task
    def stream(self) -> None:
        opts = self.environment.parsed_options
        tokens = opts.long_tokens if self.rng.random() < opts.long_fraction else opts.short_tokens
        prompt = self.rng.choice(_PROMPTS)
        body: dict[str, Any] = {"model": _MODEL[0], "stream": True, "temperature": opts.temperature}
        if self.rng.random() < opts.responses_fraction:
            path, api = "/v1/responses", "responses"
            body |= {"input": prompt, "max_output_tokens": tokens}
        else:
            chat = self.rng.random() < opts.chat_fraction
            path, api = ("/v1/chat/completions", "chat") if chat else ("/v1/completions", "completions")
            body |= {"stream_options": {"include_usage": True}, "max_tokens": tokens}
            body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        self._stream(path, body, api)

    def _stream(self, path: str, body: dict[str, Any], api: str) -> None:
        t0 = time.perf_counter()
        first = last = None
        itl: list[float] = []
        tokens, done = 0, False
        with self.client.post(path, json=body, stream=True, catch_response=True, name=f"{path} (stream)",
                              timeout=600) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:300]}")
                return
            try:
                for raw in r.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]" and api != "responses":
                        done = True
                        break
                    text, stated, ends, error = _read(json.loads(data))
                    if error is not None:
                        r.failure(f"error event: {error}")
                        return
                    tokens = tokens if stated is None else stated
                    done = ends
                    if text:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
                    if done:
                        break
            except (ValueError, KeyError, OSError) as e:
                r.failure(f"bad stream: {e!r}")
                return
            if not done:
                r.failure("the stream ended without " + ("its final event" if api == "responses" else "[DONE]"))
                return
            r.success()
        end = time.perf_counter()
        self._fire("E2E", end - t0, tokens)
        if first is not None:
            self._fire("TTFT", first - t0, tokens)
            for gap in itl:
                self._fire("ITL", gap, 0)
            if tokens > 1:
                self._fire("TPOT", (last - first) / (tokens - 1), tokens)

    def _fire(self, name: str, seconds: float, length: int) -> None:
        self.environment.events.request.fire(request_type="LLM", name=name, response_time=seconds * 1000.0,
                                             response_length=length, exception=None, context={})
