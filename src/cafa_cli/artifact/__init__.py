"""The class-statistics artifact `cafa stats` writes: the format and its checks
(format.py, docs/reference/artifact-format.md), writing and reading it (store.py), and whether it
belongs to a model (provenance.py)."""
