"""What several methods share, so that no method imports another: the compact ReLU and max-pool
layers and their autograd ops (`compact`), saved-tensor hooks that chain (`hooks`) and module
surgery (`swap`). Nothing here imports a method."""
