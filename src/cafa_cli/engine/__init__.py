"""What runs any method online: the Method protocol (method.py), the Adapter that steps a
model with one (adapter.py), the statistics its normalisation layers use (norms.py,
class_balanced.py), its optimiser, its options and their checks, its saved state and export
(state.py, serving.py), and the CUDA graph of its step. Nothing here reads a settings object
or names a command-line flag, so it can be lifted into any loop."""
