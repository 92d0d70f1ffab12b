"""What several commands share: reading the model and data (inputs), guarding outputs,
progress (monitor), torchrun, results and their reports, the clean-set check."""
