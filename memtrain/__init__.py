"""memtrain: how much GPU memory does a training run need, and what does each saving cost?"""

__version__ = "0.1.0"
