"""Datasets (features float32, labels int64): their configs (`config`, torch-free: the control plane reads them),
loading (`loader`) and deterministic batching (`batches`)."""
