"""Where images come from and how they reach the model: sources (folders, arrays,
stdin, named training sets), sampling, loading and preprocessing."""
