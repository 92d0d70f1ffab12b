"""The classifier: a model by name (loading.py; torchvision, timm and bundled ones through
hub.py and zoo/), its weights read safely (checkpoints.py), and the feature hook that makes
it return features beside logits (features.py)."""
