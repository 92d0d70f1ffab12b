"""cafa: test-time adaptation with Class-Aware Feature Alignment."""

__version__ = "0.1.0"

# the artifact cafa stats writes and cafa adapt reads when none is named
DEFAULT_ARTIFACT = "cafa-stats.safetensors"
