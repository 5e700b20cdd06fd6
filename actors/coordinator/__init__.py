"""The coordinator: the step loop (coordinator.py) and the components it holds: the weight-sync handshake
(sync.py), checkpoints and resume (checkpoint.py, exports in export.py), where metrics go (report.py); the
prompt tasks it publishes (prompts.py) and its data cursor (cursor.py)."""
