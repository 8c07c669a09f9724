"""Helpers for the service tests: a tiny model pair with the real Qwen tokenizer, free ports, a local Ray cluster,
bounded polling. Not a conftest (tests/conftest.py belongs to the engine tests); the service tests import it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsde_bench.ports import free_port  # noqa: F401  (the service tests import it from here)

TINY_VOCAB = 151936  # the real Qwen2.5 vocabulary size: the real tokenizer decodes every id
DRAFT_NOISE = 0.02


def qwen_tokenizer_dir() -> Path:
    """The embedded draft's directory (converted on first use): its tokenizer is the real Qwen tokenizer."""
    from dsde_core.models.loader import DEFAULT_DRAFT
    from dsde_core.models.packaged import EMBEDDED, ensure_embedded

    return Path(ensure_embedded(EMBEDDED[DEFAULT_DRAFT]))


def make_tiny_pair(root: Path, noise: float = DRAFT_NOISE, seed: int = 0) -> tuple[Path, Path]:
    """(target_dir, draft_dir): random-weight Qwen2 (hidden 64, 2 layers, fp32) with the real tokenizer, saved with
    save_pretrained so the service loads them through the normal path. The draft is the target plus noise, so
    draft and target agree often but not always."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    target_dir, draft_dir = root / "tiny-target", root / "tiny-draft"
    if (target_dir / "config.json").exists() and (draft_dir / "config.json").exists():
        return target_dir, draft_dir
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.25, tie_word_embeddings=False, bos_token_id=151643,
                         eos_token_id=[151645, 151643])
    target = Qwen2ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    draft = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for (_, t), (_, d) in zip(target.state_dict().items(), draft.state_dict().items(), strict=True):
            d.copy_(t + noise * t.std() * torch.randn(t.shape, generator=gen) if t.numel() > 1 else t)
    for model, out in ((target, target_dir), (draft, draft_dir)):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return target_dir, draft_dir


def start_ray(metrics_port: int) -> None:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20,
             log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 2000})


def wait_for(fn: Callable[[], Any], timeout: float, interval: float = 0.5, what: str = "condition") -> Any:
    """Call fn until it returns something truthy; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - polling: the last error is reported on timeout
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_exc!r}")


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_post(url: str, body: Any, timeout: float = 120, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def schema_verdicts(model: Any, bodies: list[dict[str, Any]]) -> list[bool]:
    """Whether each body is valid, by the request model's JSON schema (what clients and schemathesis read) and by its
    validator (what the endpoint does), asserted to agree body by body."""
    import jsonschema
    from pydantic import ValidationError

    schema = jsonschema.Draft202012Validator(model.model_json_schema())
    verdicts = []
    for body in bodies:
        try:
            model.model_validate(body)
            valid = True
        except ValidationError:
            valid = False
        assert schema.is_valid(body) == valid, body
        verdicts.append(valid)
    return verdicts


def make_tiny_gguf_pair(root: Path, models: tuple[Path, Path]) -> tuple[Path, Path]:
    """(target, draft) of make_tiny_pair's directories as F32 GGUF files with the real Qwen tokenizer (copied from the
    embedded draft's GGUF), for the llama.cpp backend."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from dsde_core.models.llama_cpp import embedded_gguf
    from dsde_core.models.loader import DEFAULT_DRAFT
    from tests.tiny_gguf import write_qwen2_gguf

    real = embedded_gguf(DEFAULT_DRAFT)
    out = []
    for src in models:
        dest = root / f"{src.name}.gguf"
        if not dest.exists():
            state = load_file(str(src / "model.safetensors"))
            write_qwen2_gguf(dest, AutoConfig.from_pretrained(str(src)), state, tokenizer_of=real)
        out.append(dest)
    return out[0], out[1]


def pin_policy(app: dict[str, Any], policy: str) -> None:
    """A Serve config application's policy, set where the replica starts (its args) and where Serve applies it
    (every deployment's user_config)."""
    app["args"]["policy"] = policy
    for deployment in app["deployments"]:
        deployment["user_config"]["policy"] = policy
