"""The device-resident step's parts on a GPU: the Triton attention kernel against the torch path, and the batched
rejection sampler on the device against the CPU, on the embedded pair's shapes with random weights. Not a test.

What it measures and checks (CUDA events, medians; random bf16 weights of the real shapes time what real ones do):
- the device's copy bandwidth (a device-to-device copy of 1 GiB), hence the bandwidth floor of a forward:
  (weight bytes + the rows' KV bytes) / bandwidth;
- per-forward ms of target and draft, attention "torch" against "triton", by batch x query length x context, with
  the achieved fraction of the floor and the draft/target ratio;
- the kernel's logits against the torch path's on the same inputs (max abs difference, bf16);
- verify_batch on the device against the CPU for the same uniforms: the tokens must be equal;
- host syncs of one verify_batch call (dsde_core/syncs.py): 0.
A time guard stops the grid before --budget seconds and writes what it has. On a CPU (--tiny: the tiny shapes,
Triton under its interpreter) it runs the same code paths in seconds, which the test suite checks.

    python benchmarks/gpu_step.py --configs DIR --out results/gpu/step_h200.json   # DIR/{target,draft}.json
    TRITON_INTERPRET=1 python benchmarks/gpu_step.py --tiny --device cpu --out /tmp/step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_costs import random_model  # noqa: E402

from dsde_core.models.llama import LlamaModel  # noqa: E402
from dsde_core.models.runner import ModelRunner  # noqa: E402
from dsde_core.syncs import SyncCounter  # noqa: E402
from dsde_core.verify import verify_batch  # noqa: E402

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": True}


def timer(device: str) -> Callable[[Callable[[], Any], int], float]:
    """A function timing fn() over n repeats, median seconds: CUDA events on a GPU, the wall clock elsewhere."""
    def cuda(fn: Callable[[], Any], n: int) -> float:
        fn()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def wall(fn: Callable[[], Any], n: int) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cuda if device.startswith("cuda") else wall


def copy_bandwidth(device: str, nbytes: int, time_fn: Callable) -> float:
    """Bytes per second of a device-to-device copy (read + write counted once each)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_fn(lambda: dst.copy_(src), 5)


def forward_ms(runner: ModelRunner, batch: int, qlens: list[int], context: int, time_fn: Callable,
               repeats: int) -> list[float]:
    """Seconds of one forward of `batch` rows of q tokens after `context` cached ones, for each q of qlens (the
    logits of every query position, left on the device): the context is prefilled once."""
    slots = list(range(batch))
    for s in slots:
        runner.set_length(s, 0)
        runner.forward([s], [[1] * context], [1])

    def one(q: int) -> None:
        for s in slots:
            runner.set_length(s, context)
        runner.forward(slots, [[1] * q] * batch, [q] * batch)

    return [time_fn(lambda q=q: one(q), repeats) for q in qlens]


def kernel_agreement(model: LlamaModel, device: str, context: int) -> float:
    """Max abs difference of the logits of a ragged decode/verify step, Triton kernel against the torch path."""
    outs = []
    for attention in ("torch", "triton"):
        runner = ModelRunner(model, 4, context + 16, attention=attention)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.args.vocab_size, (context - 7 * s,), generator=gen).tolist()
                   for s in range(4)]
        for s, p in enumerate(prompts):
            runner.forward([s], [p], [1])
        steps = [[1 + s % 5 for s in range(4)], [1] * 4]
        out = []
        for lens in steps:
            toks = [torch.randint(0, model.args.vocab_size, (n,), generator=gen).tolist() for n in lens]
            out.append(runner.forward(list(range(4)), toks, lens).float().cpu())
        outs.append(torch.cat(out))
    return float((outs[0] - outs[1]).abs().max())


def verify_on_device(device: str, vocab: int, rows: int = 32, k: int = 4, top_k: int = 8) -> dict[str, Any]:
    """verify_batch on `device` against the CPU for the same inputs and uniforms, and its host syncs there."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(3 * torch.randn(rows, k + 1, vocab, generator=gen), -1)
    q_ids = torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(rows * k)]).view(rows, k, top_k)
    q_probs = torch.softmax(torch.randn(rows, k, top_k, generator=gen), -1)
    drafts = q_ids[..., 0]
    num = torch.randint(0, k + 1, (rows,), generator=gen)
    args = (p.view(-1, vocab), (k + 1) * torch.arange(rows), torch.arange(rows) % 3 == 0, drafts, num, q_ids, q_probs,
            torch.rand(rows, k + 1, generator=gen))
    cpu = verify_batch(*args)
    on = [a.to(device) for a in args]
    with SyncCounter() as c:
        dev = verify_batch(*on)
    equal = all(torch.equal(x, y.cpu()) for x, y in zip(cpu, dev, strict=True))
    return {"rows": rows, "k": k, "vocab": vocab, "tokens_equal_cpu": equal, "host_syncs": c.total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=Path, help="folder with target.json and draft.json (HF configs)")
    p.add_argument("--tiny", action="store_true", help="the tiny shapes (a CPU smoke run of the same code)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--queries", default="1,2,5,9")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which the grid stops (default 420)")
    args = p.parse_args()
    if args.configs is None and not args.tiny:
        p.error("give --configs DIR (the pair's HF configs) or --tiny")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --device cpu --tiny (and TRITON_INTERPRET=1)")
    start, dtype = time.monotonic(), torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    time_fn = timer(args.device)
    models = {}
    for role in ("target", "draft"):
        config = {**TINY, "num_hidden_layers": 2 if role == "target" else 1} if args.tiny else \
            args.configs / f"{role}.json"
        models[role] = random_model(config, dtype, args.device)
    batches, queries, contexts = ([int(x) for x in v.split(",")] for v in (args.batches, args.queries, args.contexts))
    bandwidth = copy_bandwidth(args.device, (1 << 30) if args.device.startswith("cuda") else (1 << 24), time_fn)
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_gbs": bandwidth / 1e9,
        "shapes": {r: m[1] for r, m in models.items()},
        "kernel_max_abs_diff": {r: kernel_agreement(m[0], args.device, min(contexts)) for r, m in models.items()},
        "verify": verify_on_device(args.device, models["target"][0].args.vocab_size),
        "columns": ["model", "attention", "batch", "query_tokens", "context", "ms", "floor_ms", "of_floor"],
        "forwards": [], "complete": False,
    }
    max_len = max(contexts) + max(queries) + 1
    runners = {(r, a): ModelRunner(m[0], max(batches), max_len, attention=a)
               for r, m in models.items() for a in ("torch", "triton")}
    for (role, attention), runner in runners.items():
        model = models[role][0]
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        per_token_kv = 2 * model.args.num_layers * model.args.num_kv_heads * model.args.head_dim * dtype.itemsize
        for context in contexts:
            for batch in batches:
                if time.monotonic() - start > args.budget:
                    break
                for qlen, s in zip(queries, forward_ms(runner, batch, queries, context, time_fn, args.repeats),
                                   strict=True):
                    floor = (weights + batch * (context + qlen) * per_token_kv) / bandwidth
                    doc["forwards"].append([role, attention, batch, qlen, context, 1e3 * s, 1e3 * floor, floor / s])
    doc["complete"] = len(doc["forwards"]) == len(runners) * len(contexts) * len(batches) * len(queries)
    doc["seconds"] = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"device {doc['device']}  copy {doc['copy_bandwidth_gbs']:.0f} GB/s  kernel diff "
          f"{doc['kernel_max_abs_diff']}  verify {doc['verify']}")
    print(f"{'model':6} {'attn':6} {'B':>3} {'q':>2} {'ctx':>5} {'ms':>8} {'floor':>7} {'of floor':>8}")
    for role, attention, b, q, c, ms, fl, frac in doc["forwards"]:
        print(f"{role:6} {attention:6} {b:3d} {q:2d} {c:5d} {ms:8.3f} {fl:7.3f} {frac:8.2f}")
    if not doc["complete"]:
        print(f"time guard: stopped after {len(doc['forwards'])} forwards ({doc['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
