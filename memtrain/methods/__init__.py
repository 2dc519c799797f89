"""Memory-saving methods: one module per single-file method (none, pool, prune, quantize,
offload, stack), one package per multi-file method (checkpoint/, synthetic/: `strategies.py`
and `phases.py` hold the classes, which the package re-exports under the name its YAML's
`_target_` holds), and common/ for what several methods share (compact ReLU/max-pool,
saved-tensor hooks, activation detection, module surgery). A method imports common/, never
another method (tests/test_imports.py). A method is any object with the members the contract
lists (`base.py`: no base class to inherit; the core calls a method's hooks only through it);
one module (or folder) plus one conf/method/*.yaml adds a method, nothing else is edited."""
