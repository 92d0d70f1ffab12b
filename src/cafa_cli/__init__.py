"""cafa: test-time adaptation with Class-Aware Feature Alignment."""

__version__ = "0.1.0"
