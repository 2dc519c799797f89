"""What several methods share, so that no method imports another: the compact ReLU and max-pool
modules and their autograd Functions (`compact`: pool, quantize, checkpoint's compaction),
saved-tensor hooks that chain (`hooks`: quantize, offload, checkpoint), which saved tensors are
activations (`activations`: quantize, offload) and module surgery (`swap`). Nothing here imports
a method."""
