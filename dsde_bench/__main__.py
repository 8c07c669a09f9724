"""python -m dsde_bench [dsde bench flags] | python -m dsde_bench report"""

import sys

from dsde_bench.cli import main

sys.exit(main())
