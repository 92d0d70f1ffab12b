"""`cafa plot features`: one domain's features before and after adaptation (features.py runs, figure.py draws)."""
