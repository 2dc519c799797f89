"""`python -m memtrain.kernels.bench prune|bitmask [...]`: the kernel benchmarks' command.

The name is kept stable for scripts; the benchmarks live with the others in
memtrain/bench/kernels.py. Nothing imports this module: kernels/ imports only torch and triton
(benchmarks import kernels, never the reverse), so the hand-over happens when it runs as a script.
"""

if __name__ == "__main__":
    from memtrain.bench.kernels import main

    main()
