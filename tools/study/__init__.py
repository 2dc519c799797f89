"""Studies: `make results` runs the GPU study, part by part (each part the commands a user
would type: memtrain sweeps, benchmarks, the CUDA tests), and writes its view, docs/results/<name>/
(results.md with every table, memtrain-report's report and figures).

    python -m tools.study --device cpu --dry-run    # the commands and their budgets

- `results.py`: the driver (`python -m tools.study`, the same as `python -m
  tools.study.results`): parts, timeouts, signals, statuses, the archive;
- `study_plan.py`: the parts, their sizes (PROFILES, `--set PART.KEY=VALUE`) and their command
  lines;
- `study_tables.py`: results.md's tables, built on memtrain/report/ (its row loader, ratios, units,
  number format and setting labels);
- `view.py`: the view, made again from every raw result at the end of each invocation.
"""
