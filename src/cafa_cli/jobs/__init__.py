"""The work of each command, as functions of a settings object: one folder or module a
command (adapt/, bench/, plot/, stats.py, demo.py, inspect.py, methods.py), the settings
they are built from (config/), and what several of them share (shared/). They combine
the layers below (method, data, models, artifact) and name no command-line flag."""
