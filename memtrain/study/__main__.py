"""`python -m memtrain.study`: the study's driver (memtrain/study/results.py)."""

import sys

from memtrain.study.results import main

sys.exit(main())
