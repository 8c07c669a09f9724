"""How close is the sparse KLD (the draft's top-K ids plus one rest bin) to the exact full-vocabulary KLD?

    .venv/bin/python benchmarks/kld_fidelity.py [--tokens 96] [--k 64] [--out results/kld_fidelity.json]

Along the target's own greedy output for a few prompts, at every position: the target's and the draft's
full next-token distributions (temperature 1, as the signal uses for greedy requests), the exact
KL(p || q), and the sparse lower bound that crosses between workers. Prints the Spearman rank
correlation, the Pearson correlation and the median ratio sparse / full.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from scipy.stats import pearsonr, spearmanr

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.llm import SpeculativeLLM
from dsde_core.models.runner import ModelRunner
from dsde_core.signals import full_kld, sparse_kld

PROMPTS = [
    "Write a Python function that parses a CSV line with quoted fields.",
    "Explain the difference between a process and a thread.",
    "Write a haiku about autumn, then explain its imagery.",
    "Implement binary search in Python and explain its complexity.",
]


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--out", default="results/kld_fidelity.json")
    args = ap.parse_args()
    llm = SpeculativeLLM.load(config=EngineConfig(max_batch_size=1, dtype="bfloat16"))
    sparse, full = [], []
    for prompt in PROMPTS:
        ids = llm.encode(prompt, chat=True)
        [res] = llm.generate([ids], SamplingParams(max_tokens=args.tokens), policy="off")
        seq = ids + res.token_ids
        logits = {}
        for name, loaded in (("p", llm.target), ("q", llm.draft)):
            runner = ModelRunner(loaded.model, 1, len(seq) + 1)
            n = len(res.token_ids)
            logits[name] = runner.forward([0], [seq[:-1]], [n])  # [n, V]: next-token logits along the output
        p = torch.softmax(logits["p"], -1)
        q = torch.softmax(logits["q"], -1)
        q_top, q_ids = torch.topk(q, args.k, dim=-1)
        sparse += sparse_kld(p, q_ids, q_top).tolist()
        full += full_kld(p, q).tolist()
    s, f = np.array(sparse), np.array(full)
    result = {
        "positions": len(s),
        "k": args.k,
        "spearman": float(spearmanr(s, f).statistic),
        "pearson": float(pearsonr(s, f).statistic),
        "median_ratio_sparse_over_full": float(np.median(s[f > 1e-6] / f[f > 1e-6])),
        "mean_sparse": float(s.mean()),
        "mean_full": float(f.mean()),
        "sparse_le_full_fraction": float(np.mean(s <= f + 1e-5)),
    }
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
