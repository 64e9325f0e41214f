"""CUDA C sources of attnlab's kernels (shipped in the wheel as ``attnlab.kernels``)."""
