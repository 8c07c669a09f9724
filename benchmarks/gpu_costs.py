"""Step costs of the engine's forwards on a GPU, for the simulator: the embedded pair's shapes with random weights.

The weights' values do not change a forward's time, so a machine that cannot hold the real weights (a lent GPU that
reaches no package index) still measures what the real pair's forwards cost there. Writes a costs file in the format
of results/costs.json (`dsde bench --simulate --costs NAME=FILE --profiles NAME` prices traces with it), plus the
batched verification table B rows x q tokens at a longer context, which the one-slot table approximates.

    python benchmarks/gpu_costs.py --configs DIR --out results/costs_h100.json   # DIR/{target,draft}.json

The static step's table (captured CUDA graphs, fused small ops) is written by gpu_step.py --costs-out with
`costs_doc` below, from the runners it has captured already.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dsde_bench.provenance import code_version
from dsde_bench.sim.costs import measure_costs
from dsde_core.models.llama import LlamaModel
from dsde_core.models.runner import ModelRunner
from dsde_core.models.static_step import StaticRunner


def random_model(config: Path | dict[str, Any], dtype: torch.dtype, device: str) -> tuple[LlamaModel, dict[str, Any]]:
    """A LlamaModel of the config's shapes (a config.json, or its contents) with N(0, 0.02) weights (norms at 1),
    built on `device`."""
    raw = config if isinstance(config, dict) else json.loads(config.read_text())
    config = Qwen2Config(**{k: v for k, v in raw.items() if not k.startswith("_")})
    with torch.device("meta"):
        names = {k: v.shape for k, v in Qwen2ForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    state = {k: (torch.ones(s, device=device, dtype=dtype) if "norm" in k else
                 0.02 * torch.randn(s, device=device, dtype=dtype, generator=gen)) for k, s in names.items()}
    shape = {k: raw.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    return LlamaModel.from_hf(config, state, dtype=dtype, device=device), shape


def batched_table(runner: ModelRunner | StaticRunner, batches: tuple[int, ...], queries: tuple[int, ...], context: int,
                  repeats: int = 5) -> list[list[float]]:
    """[B, q, seconds]: one forward of B rows of q query tokens each after `context` cached tokens (min of repeats),
    the logits of every query position copied to the host (which waits for the forward)."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    out = []
    for b in batches:
        slots = list(range(b))
        for s in slots:
            runner.set_length(s, 0)
            runner.forward([s], [[1] * context], [1])
        for q in queries:
            best = math.inf
            for rep in range(repeats + 1):
                for s in slots:
                    runner.set_length(s, context)
                sync()
                t0 = time.perf_counter()
                runner.forward(slots, [[1] * q] * b, [q] * b).cpu()
                if rep:
                    best = min(best, time.perf_counter() - t0)
            out.append([float(b), float(q), best])
        for s in slots:
            runner.set_length(s, 0)
    return out


def costs_doc(t_run: Any, d_run: Any, shapes: dict[str, Any], name: str, context: int,
              meta: dict[str, Any], one_slot_context: int = 128) -> dict[str, Any]:
    """The costs file of a target and a draft runner (results/costs.json's format, the profile `name`): the one-slot
    table of n = 1..256 query tokens (as far as the cache holds) after one_slot_context cached ones, and the batched
    table B rows x q tokens after `context`."""
    model = replace(measure_costs(t_run, d_run, context=one_slot_context), name=name)
    cuda = t_run.device.type == "cuda"
    batches, queries = (1, 2, 4, 8, 16, 32, 64), (1, 2, 3, 5, 9)
    slots = t_run.cache.num_slots - isinstance(t_run, StaticRunner)  # the static runner's last slot is scratch
    batches = tuple(b for b in batches if b <= slots)
    queries = tuple(q for q in queries if context + q <= t_run.cache.max_seq_len)
    return {
        "backend": {"draft": "qwen2.5-coder-0.5b-instruct shapes, random weights",
                    "target": "qwen2.5-coder-1.5b-instruct shapes, random weights",
                    "dtype": str(t_run.model.dtype).removeprefix("torch."),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "shapes": shapes},
        "model": model.__dict__,
        "batched": {"context": context, "columns": ["batch", "query_tokens_per_row", "seconds"],
                    "target": batched_table(t_run, batches, queries, context),
                    "draft": batched_table(d_run, batches, (1,), context)},
        "meta": {**meta, "code": code_version(), "torch": torch.__version__,
                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=Path, required=True, help="folder with target.json and draft.json (HF configs)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=512, help="cached tokens before the batched table's queries")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_costs.py: no CUDA device here")
    dtype = torch.bfloat16
    target, tshape = random_model(args.configs / "target.json", dtype, args.device)
    draft, dshape = random_model(args.configs / "draft.json", dtype, args.device)
    slots, max_len = 64, 2048
    t_run, d_run = ModelRunner(target, slots, max_len), ModelRunner(draft, slots, max_len)
    command = "python benchmarks/gpu_costs.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items())
    doc = costs_doc(t_run, d_run, {"target": tshape, "draft": dshape}, "gpu-measured", args.context,
                    {"command": command})
    model = doc["model"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    t, d = dict(map(tuple, model["points"]["target"])), dict(map(tuple, model["points"]["draft"]))
    print(f"{'n':>4} {'target ms':>10} {'draft ms':>9} {'ratio':>6}")
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        if n in t:
            print(f"{n:4d} {1e3 * t[n]:10.2f} {1e3 * d[n]:9.2f} {d[n] / t[n]:6.2f}")
    print(f"batched target (context {args.context}): B q ms")
    for b, q, s in doc["batched"]["target"]:
        print(f"  {int(b):3d} {int(q)} {1e3 * s:7.2f}")
    print("batched draft: B ms", " ".join(f"{int(b)}:{1e3 * s:.2f}" for b, _, s in doc["batched"]["draft"]))


if __name__ == "__main__":
    main()
