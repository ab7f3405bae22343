"""What the control plane, the training driver and the agents exchange: one type per concept, end to end.
Importing neither Django nor grpc, so each side reads the same definitions."""
