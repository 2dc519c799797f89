"""`python -m tools.study`: the study's driver (tools/study/results.py)."""

import sys

from tools.study.results import main

sys.exit(main())
