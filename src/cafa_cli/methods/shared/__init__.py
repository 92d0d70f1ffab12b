"""What several methods share: objectives (losses.py), sample selection, augmentations,
memory banks, the teacher-student and prototype terms, LAME's Laplacian correction."""
