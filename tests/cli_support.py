"""A command's options as its --help prints them: the public face a flag-coverage test checks against."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from unittest import mock

import pytest


def help_flags(parser: argparse.ArgumentParser, *command: str) -> set[str]:
    """The long options that `prog COMMAND --help` prints (usage line and option list), --help itself aside. Printed
    unwrapped (argparse wraps to $COLUMNS, and may break a flag a description names at its hyphen)."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "100000"}), contextlib.redirect_stdout(out), \
            pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue())) - {"--help"}
