"""The contributor's node agent: hosts pipeline stages and serves them over gRPC."""
