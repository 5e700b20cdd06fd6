"""The learner: the DeepSpeed engine and loss (engine.py, learner.py), attention and the log-prob head,
optimizer offload, one rank's Ray shell (shell.py) and the group of ranks (group.py)."""
