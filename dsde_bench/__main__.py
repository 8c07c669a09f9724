"""python -m dsde_bench [dsde bench flags] | python -m dsde_bench report: `dsde bench` (dsde_cli.bench)."""

import sys

from dsde_cli.bench import main

sys.exit(main())
