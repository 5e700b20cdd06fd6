"""The generator: a plain Generator over one inference engine (generator.py) and its thin Ray shell
(shell.py). The engines themselves live in actors/engines/."""
