"""`make bench-goodput`, CI-sized: each `dsde bench` command of its four runs exactly as the Makefile has it, on the
tiny random pair with a few short prompts and two rounds, then the report. Its flags work together and the page
judges all of issue 7's targets from the four files: a ~145-minute run fails here first, not at its end."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from dsde_bench import cli, report
from tests.test_bench_runner import needs_data

ROOT = Path(__file__).resolve().parents[1]
# what makes it CI-sized; argparse keeps an option's last value, so these override the Makefile's
SMALL = ["--tiny", "--num-prompts", "4", "--max-tokens", "4", "--repeats", "2", "--warm-requests", "1", "--no-plots",
         "--no-anchor"]
RUNS = {"bench": "(bench)", "goodput_lowacc": "(goodput_lowacc)", "goodput_weak": "(goodput_weak, draft noise 8)",
        "goodput_batch": "(goodput_batch)"}


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
    page = report.render(tmp_path, tmp_path)
    _, found, section = page.partition("### Targets of issue 7 (")
    assert found, page
    title, _, rest = section.partition("\n")
    table = rest.split("\n#", 1)[0]  # up to the next heading
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| target |")]
    assert len(rows) == 11, rows  # every target the real run is judged on
    assert title.endswith(f"of {len(rows)} met)"), title
    for name, cited in RUNS.items():
        assert any(cited in row for row in rows), (name, rows)
