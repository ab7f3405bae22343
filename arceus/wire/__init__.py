"""How tensors travel: raw little-endian bytes with dtype and shape, validated before use."""
