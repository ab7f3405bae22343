"""Models: declarative specs (torch-free), a registry of architectures (`registry.py`), and one folder per
architecture holding its spec, layers, tensor-parallel layers and dataset fitting."""
