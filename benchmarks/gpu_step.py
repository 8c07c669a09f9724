"""The device-resident step on a GPU: the static step's captured graphs against the eager forward, the Triton
attention kernel against the torch path, the batched rejection sampler on the device against the CPU, and the
engine's speed at a controlled acceptance, on the embedded pair's shapes with random weights. Not a test.

What it measures and checks (CUDA events, medians; random bf16 weights of the real shapes time what real ones do):
- the device's copy bandwidth (a device-to-device copy of 1 GiB), hence the bandwidth floor of a forward:
  (weight bytes + the rows' KV bytes) / bandwidth;
- on the tiny fp32 models: the static step (captured graphs, fused small ops) against the eager forward in logits,
  and greedy speculation on it against target-only in tokens;
- the kernel's logits against the torch path's on the same inputs (max abs difference, bf16);
- verify_batch on the device against the CPU for the same uniforms: the tokens must be equal; its host syncs: 0;
- per-forward ms of target and draft by batch x query length x context for the eager forward with attention
  "torch" and "triton" and for the static step ("static": captured graphs with fused small ops on CUDA), with the
  achieved fraction of the floor; the seconds the static step took to compile and to capture;
- engine tokens/s on the static runners (benchmarks/controlled.py): target-only, and each policy at each controlled
  acceptance alpha, by batch size, with the acceptance that held and whether the output equalled target-only's.
A time guard stops the forward grid at 55% of --budget seconds and the engine runs at --budget, and writes what it
has. On a CPU (--tiny: the tiny shapes, Triton under its interpreter, nothing captured) it runs the same code paths
in seconds, which the test suite checks.

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
from controlled import run_engine, speed_table  # noqa: E402
from gpu_costs import costs_doc, random_model  # noqa: E402

from dsde_core.config import EngineConfig  # noqa: E402
from dsde_core.models.llama import LlamaModel  # noqa: E402
from dsde_core.models.runner import ModelRunner  # noqa: E402
from dsde_core.models.static_step import StaticRunner  # noqa: E402
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


def static_agreement(device: str) -> dict[str, Any]:
    """On the tiny fp32 models: the static step (captured and fused on CUDA) against the eager forward over ragged
    decode and verify calls (max abs logit difference), and greedy speculation on static runners (static:3 at
    acceptance 0.8) against target-only on the eager one (tokens equal)."""
    cuda = device.startswith("cuda")
    target, draft = (random_model({**TINY, "num_hidden_layers": n}, torch.float32, device)[0] for n in (2, 1))
    eager = ModelRunner(target, 4, 64)
    static = StaticRunner(random_model({**TINY, "num_hidden_layers": 2}, torch.float32, device)[0], 4, 64, 5,
                          attention="triton", graphs=cuda, fuse=cuda)
    static.capture()
    gen, diff = torch.Generator().manual_seed(2), 0.0
    for s in range(4):
        prompt = torch.randint(0, TINY["vocab_size"], (9 + s,), generator=gen).tolist()
        eager.forward([s], [prompt], [1])
        static.forward([s], [prompt], [1])
    for step in range(4):
        q = [1 + (step + s) % 5 for s in range(4)]
        toks = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in q]
        a, b = eager.forward(list(range(4)), toks, q), static.forward(list(range(4)), toks, q)
        diff = max(diff, float((a - b).abs().max()))
    config = EngineConfig(max_batch_size=4, max_seq_len=64, dtype="float32", device=device, max_sl=4)
    prompts = [torch.randint(0, TINY["vocab_size"], (8,), generator=gen).tolist() for _ in range(3)]
    _, ref, _ = run_engine(ModelRunner(target, 4, 64), None, config, "off", prompts, 24)
    draft_runner = StaticRunner(draft, 4, 64, 5, attention="triton", graphs=cuda)
    draft_runner.capture()
    _, outs, _ = run_engine(static, draft_runner, config, "static:3", prompts, 24, 0.8,
                            {tuple(p): p + o for p, o in zip(prompts, ref, strict=True)})
    return {"static_max_abs_diff": diff, "speculation_equals_target_only": outs == ref, "graphs": len(static.graphs)}


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


def build_static(model: LlamaModel, slots: int, max_len: int, max_query: int, device: str, doc: dict[str, Any],
                 role: str) -> StaticRunner:
    """The static runner of `model` (on CUDA: small ops fused, every bucket captured), with the seconds its compile
    and its capture took written to doc[...][role]."""
    cuda = device.startswith("cuda")
    runner = StaticRunner(model, slots, max_len, max_query, attention="triton", graphs=cuda, fuse=cuda)
    runner.capture()
    for key, value in (("compile_s", runner.compile_s), ("capture_s", runner.capture_s),
                       ("graphs", len(runner.graphs))):
        doc.setdefault(key, {})[role] = value
    return runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=Path, help="folder with target.json and draft.json (HF configs)")
    p.add_argument("--tiny", action="store_true", help="the tiny shapes (a CPU smoke run of the same code)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--costs-out", type=Path, help="also write the static step's costs file (gpu_costs.py's format)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--queries", default="1,2,5,9")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--policies", default="static:2,static:4,dsde,dsde-goodput")
    p.add_argument("--alphas", default="0.6,0.8,0.95")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds after which the engine runs stop, the forward grid at 55%% of it (default 420)")
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
        "tiny_static": static_agreement(args.device),
        "columns": ["model", "attention", "batch", "query_tokens", "context", "ms", "floor_ms", "of_floor"],
        "forwards": [], "complete": False,
    }
    max_len = max(contexts) + max(queries) + 1
    grid = [(role, attention) for role in models for attention in ("torch", "triton", "static")]
    static: dict[str, StaticRunner] = {}
    for role, attention in grid:
        model = models[role][0]
        if attention == "static":  # after the eager runs: fusing changes the model they share
            runner = static[role] = build_static(model, max(batches), max_len, max(queries), args.device, doc, role)
        else:
            runner = ModelRunner(model, max(batches), max_len, attention=attention)
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        per_token_kv = 2 * model.args.num_layers * model.args.num_kv_heads * model.args.head_dim * dtype.itemsize
        for context in contexts:
            for batch in batches:
                if time.monotonic() - start > 0.55 * args.budget:
                    break
                for qlen, s in zip(queries, forward_ms(runner, batch, queries, context, time_fn, args.repeats),
                                   strict=True):
                    floor = (weights + batch * (context + qlen) * per_token_kv) / bandwidth
                    doc["forwards"].append([role, attention, batch, qlen, context, 1e3 * s, 1e3 * floor, floor / s])
        if attention != "static":
            del runner  # its cache: the static runners allocate theirs next
    doc["complete"] = len(doc["forwards"]) == len(grid) * len(contexts) * len(batches) * len(queries)
    if len(static) == 2 and args.costs_out is not None:  # the static step's table for the simulator (make bench-sim)
        costs = costs_doc(static["target"], static["draft"], doc["shapes"], "gpu-step", min(contexts),
                          {"command": "python benchmarks/gpu_step.py " + " ".join(sys.argv[1:]), "step": "static",
                           **{f"{r}_{k}": doc[k][r] for r in static for k in ("compile_s", "capture_s")}},
                          one_slot_context=min(128, max_len // 2))
        args.costs_out.parent.mkdir(parents=True, exist_ok=True)
        args.costs_out.write_text(json.dumps(costs, indent=1))
    if len(static) == 2:
        config = EngineConfig(max_batch_size=max(batches), max_seq_len=max_len, dtype=doc["dtype"],
                              device=args.device, max_sl=max(queries) - 1)
        runs = speed_table(static["target"], static["draft"], config, batches, args.policies.split(","),
                           [float(a) for a in args.alphas.split(",")], args.prompt_len, args.max_tokens,
                           lambda: time.monotonic() - start > args.budget)
        doc["engine"] = {"columns": ["policy", "batch", "alpha", "tokens_per_s", "acceptance", "lossless"],
                         "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                         "rows": [[r.policy, r.batch, r.alpha, r.tokens_per_s, r.acceptance, r.lossless]
                                  for r in runs]}
    doc["seconds"] = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"device {doc['device']}  copy {doc['copy_bandwidth_gbs']:.0f} GB/s  kernel diff "
          f"{doc['kernel_max_abs_diff']}  verify {doc['verify']}")
    print(f"{'model':6} {'attn':6} {'B':>3} {'q':>2} {'ctx':>5} {'ms':>8} {'floor':>7} {'of floor':>8}")
    for role, attention, b, q, c, ms, fl, frac in doc["forwards"]:
        print(f"{role:6} {attention:6} {b:3d} {q:2d} {c:5d} {ms:8.3f} {fl:7.3f} {frac:8.2f}")
    print("static step:", {k: doc[k] for k in ("compile_s", "capture_s", "graphs") if k in doc})
    only = {r[1]: r[3] for r in doc.get("engine", {}).get("rows", []) if r[2] is None}
    print(f"{'policy':13} {'B':>3} {'alpha':>5} {'tok/s':>8} {'x target':>8} {'accept':>6} lossless")
    for policy, b, alpha, tps, acc, ok in doc.get("engine", {}).get("rows", []):
        print(f"{policy:13} {b:3d} {alpha or 0:5.2f} {tps:8.1f} {tps / only[b]:8.2f} "
              f"{acc if acc is not None else float('nan'):6.2f} {ok}")
    if not doc["complete"]:
        print(f"time guard: stopped after {len(doc['forwards'])} forwards ({doc['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
