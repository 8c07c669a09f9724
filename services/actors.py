"""The model hosts: a draft and a target worker, each loading its own model where it runs.

Plain classes, run as Ray actors by services.placement (or in-process in tests). Each host loads its model
from a source string (embedded name, Hugging Face directory or .gguf file) with the configured dtype and device,
sets torch's thread count, and exposes the worker's narrow interface: open / release / propose or verify.
What crosses per step is what dsde_core's workers exchange: token ids, scalars, top-K draft distributions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from dsde_core.config import DTYPES, EngineConfig, SamplingParams
from dsde_core.llm import eos_token_ids
from dsde_core.models.backends import resolve_backend
from dsde_core.models.loader import LoadedModel, load_model
from dsde_core.policies.stopping import DraftStop
from dsde_core.workers import DraftTask, DraftWorker, Proposal, TargetWorker, Verdict, VerifyTask
from services import transport


@dataclass
class ModelInfo:
    """What the ingress needs to know about a hosted model; the tokenizer travels once, at start-up."""

    name: str
    vocab_size: int
    eos_ids: set[int]
    tokenizer: Any
    device: str
    dtype: str
    num_threads: int
    backend: str = "torch"  # the runner: torch or llama.cpp


def resolve_device(device: str) -> str:
    """'auto': cuda when this process sees a GPU (Ray hides GPUs from actors given none), else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class _ModelHost:
    def __init__(self, source: str, dtype: str, device: str, max_batch_size: int, max_seq_len: int,
                 num_threads: int | None = None, quant: str | None = None, backend: str = "auto", step: str = "eager",
                 max_query: int = 1) -> None:
        threads = num_threads or os.cpu_count() or 1
        self.device = resolve_device(device)
        self.dtype = dtype
        self.backend = resolve_backend(backend, source, self.device, dtype)  # as SpeculativeLLM.load resolves it
        # Ray sets OMP_NUM_THREADS from num_cpus; the config decides here. On llama.cpp torch only samples: one thread,
        # whose idle OpenMP pool would otherwise spin beside llama.cpp's threads
        torch.set_num_threads(1 if self.backend == "llama.cpp" else threads)
        # the same resolution of "auto" as the in-process engine (SpeculativeLLM.load), on this actor's device
        quantize = EngineConfig(dtype=dtype, device=self.device, draft_quant=quant).draft_quantize if quant else None
        self.loaded: LoadedModel = load_model(source, DTYPES[dtype], self.device, quantize, self.backend)
        self.runner = self.loaded.make_runner(max_batch_size, max_seq_len, threads, step, max_query)

    def describe(self) -> ModelInfo:
        return ModelInfo(self.loaded.name, self.runner.vocab_size, eos_token_ids(self.loaded), self.loaded.tokenizer,
                         self.device, self.dtype, torch.get_num_threads(), self.backend)

    def ping(self) -> bool:
        return True


class DraftHost(_ModelHost):
    def __init__(self, source: str, dtype: str, device: str, max_batch_size: int, max_seq_len: int,
                 num_threads: int | None = None, top_k: int = 64, quant: str = "auto",
                 window: int | None = None, backend: str = "auto", step: str = "eager", max_query: int = 1) -> None:
        super().__init__(source, dtype, device, max_batch_size, max_seq_len, num_threads, quant, backend, step,
                         max_query)
        self.worker = DraftWorker(self.runner, top_k, window=window)  # as the engine's config, which prices it
        transport.register()  # proposals leave this process packed (services/transport.py)

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        self.worker.open(slot, params, prompt_len, emitted)

    def release(self, slot: int) -> None:
        self.worker.release(slot)

    def propose(self, tasks: list[DraftTask], stop: DraftStop | None = None) -> list[Proposal]:
        return [_on_device(p, "cpu") for p in self.worker.propose(tasks, stop)]  # what crosses is on the CPU

    def num_open(self) -> int:
        return self.worker.num_open()


class TargetHost(_ModelHost):
    def __init__(self, source: str, dtype: str, device: str, max_batch_size: int, max_seq_len: int,
                 num_threads: int | None = None, backend: str = "auto", step: str = "eager",
                 max_query: int = 1) -> None:
        super().__init__(source, dtype, device, max_batch_size, max_seq_len, num_threads, backend=backend, step=step,
                         max_query=max_query)
        self.worker = TargetWorker(self.runner)

    def open(self, slot: int, params: SamplingParams, prompt_len: int = 0, emitted: int = 0) -> None:
        self.worker.open(slot, params, prompt_len, emitted)

    def release(self, slot: int) -> None:
        self.worker.release(slot)

    def verify(self, tasks: list[VerifyTask]) -> list[Verdict]:
        if self.device != "cpu":
            tasks = [replace(t, proposal=_on_device(t.proposal, self.device)) if t.proposal else t for t in tasks]
        return self.worker.verify(tasks)

    def num_open(self) -> int:
        return self.worker.num_open()


def _on_device(p: Proposal, device: str) -> Proposal:
    """The proposal with its top-K tensors on `device` (a no-op when they are there already)."""
    if all(d.ids.device.type == torch.device(device).type for d in p.dists):
        return p
    dists = [replace(d, ids=d.ids.to(device), q_sample=d.q_sample.to(device), q_signal=d.q_signal.to(device))
             for d in p.dists]
    return replace(p, dists=dists)
