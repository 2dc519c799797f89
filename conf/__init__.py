"""memtrain's config tree, installed as the package memtrain.conf: `pkg://memtrain.conf` on a
Hydra search path (Hydra reads a config package only where it has an __init__.py)."""
