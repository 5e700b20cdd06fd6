"""The coordinator: the step loop (coordinator.py), the weight-sync handshake (sync.py), checkpoints,
exports and resume (checkpoint.py)."""
