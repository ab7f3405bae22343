"""Swarm stages, the pure part: routing micro-batches among a stage's replicas, cutting and reducing the
replicas' gradient exchange, planning the repair of a step that lost a replica, and a performance model.
No gRPC, no Django, no I/O: the training driver, the agents and the controller call these."""
