"""`make bench-goodput`, CI-sized: each `dsde bench` command of its four runs exactly as the Makefile has it, on the
tiny random pair with a few short prompts and two rounds, then the report. Its flags work together and the page
judges every dsde-goodput target from the four files: a run of hours fails here first, not at its end."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from dsde_bench import report
from dsde_bench.report import targets as tg
from dsde_cli import bench as cli
from tests.test_bench_runner import needs_data, one_thread  # noqa: F401  (one_thread: autouse here too)

ROOT = Path(__file__).resolve().parents[1]
# what makes it CI-sized; argparse keeps an option's last value, so these override the Makefile's
SMALL = ["--tiny", "--num-prompts", "4", "--max-tokens", "4", "--repeats", "2", "--warm-requests", "1", "--no-plots",
         "--no-anchor"]
RUNS = {"bench": "## Policy grid at T=0", "goodput_lowacc": "## Low acceptance: chat at T=1",
        "goodput_weak": "## A weak draft", "goodput_batch": "## Batch sizes up to 16"}


def bench_commands(target: str) -> list[list[str]]:
    """The arguments of every `dsde bench` that `make TARGET` runs (its sub-makes' too), as `make -n` prints them."""
    printed = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.replace("\\\n", " ")
    commands = []
    for line in printed.splitlines():
        words = line.split()
        if len(words) > 1 and words[0].endswith("/dsde") and words[1] == "bench":
            commands.append(shlex.split(line)[2:])
    return commands


@needs_data
def test_the_four_runs_of_bench_goodput_run_small_and_the_page_judges_every_target(tmp_path: Path) -> None:
    commands = bench_commands("bench-goodput")
    outs = [Path(argv[argv.index("--out") + 1]) for argv in commands]
    assert [p.stem for p in outs] == list(RUNS), outs  # the four runs, in the Makefile's order
    for argv, out in zip(commands, outs, strict=True):
        assert cli.main([*argv, *SMALL, "--results-dir", str(tmp_path), "--out", str(tmp_path / out.name)]) == 0
        doc = json.loads((tmp_path / out.name).read_text())
        assert doc["cells"] and {c["policy"] for c in doc["cells"]} >= {"off", "dsde-goodput"}
        assert doc["backend"].get("draft_noise") == (8 if out.stem == "goodput_weak" else None)  # --tiny keeps it
    docs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in RUNS}
    # every cell a target (against the best static k, or target-only where no static k pays), and the batch sweep's
    # collapse: the published runs' 11
    assert sum(len(tg.goodput(doc)) for doc in docs.values()) == 11
    page = report.render(tmp_path, tmp_path)
    for name, heading in RUNS.items():
        section = page.split(heading + "\n")[1].split("\n## ")[0]
        assert f"`results/{name}.md`" in section and "Targets, " in section and "| dsde-goodput" in section, name
