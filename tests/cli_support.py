"""A command's options as its --help prints them: the public face a flag-coverage test checks against."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest


def help_flags(parser: argparse.ArgumentParser, *command: str) -> set[str]:
    """The long options that `prog COMMAND --help` prints (usage line and option list), --help itself aside."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue())) - {"--help"}
