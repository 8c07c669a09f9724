"""Flags several `dsde` commands share."""

from __future__ import annotations

import argparse

from dsde_core.models.backends import BACKENDS


def add_backend_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--backend and --draft-backend: which runner runs each model (dsde_core.models.backends)."""
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the models' runner: llama.cpp (a GGUF model on the CPU, run as it is), torch, or auto "
                             "(llama.cpp for a GGUF model on the CPU unless --dtype float32; default)")
    parser.add_argument("--draft-backend", default=None, choices=BACKENDS,
                        help="the draft's runner where it differs from --backend")
