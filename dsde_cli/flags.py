"""Flags several `dsde` commands share."""

from __future__ import annotations

import argparse

from dsde_core.models.backends import BACKENDS, STEPS


def add_backend_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--backend and --draft-backend: which runner runs each model (dsde_core.models.backends)."""
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the models' runner: llama.cpp (a GGUF model on the CPU, run as it is), torch, or auto "
                             "(llama.cpp for a GGUF model on the CPU unless --dtype float32; default)")
    parser.add_argument("--draft-backend", default=None, choices=BACKENDS,
                        help="the draft's runner where it differs from --backend")


def add_step_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--step: the torch runner's step (EngineConfig.step)."""
    parser.add_argument("--step", default="eager", choices=STEPS,
                        help="the torch runner's step: eager (default), or static: decode and verify calls padded to "
                             "fixed buckets over persistent buffers, captured as CUDA graphs on a GPU at start-up")
