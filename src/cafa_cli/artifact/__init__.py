"""The class-statistics artifact `cafa stats` writes: the format and its checks
(format.py, docs/reference/artifact-format.md), reading and checking it without torch (reading.py),
writing it and reading it as torch tensors (store.py), and whether it belongs to a model
(provenance.py)."""
