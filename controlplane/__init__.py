"""The Arceus control plane: a Django project holding the desired state of jobs, stages and nodes."""
