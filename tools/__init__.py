"""The maintainer's tools, run from a checkout and never installed with memtrain:

- `study/`: `make results`, the whole study part by part (`python -m tools.study`);
- `docs.py`: `make results-docs`, every generated block of the documents from committed rows;
- `doc_figures.py`: `make results-figures`, the docs' pictures of the report's figures.

They import memtrain and benchmarks/; nothing of memtrain imports them (tests/test_imports.py).
"""
