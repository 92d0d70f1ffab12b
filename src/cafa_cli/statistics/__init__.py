"""Class-conditional Gaussians of the features, in torch only: streaming moments
(moments.py), the fitted means and precision factors (gaussians.py), and the Mahalanobis
distances to them (distances.py). Start with gaussians.py."""

# here, torch-free: the command line offers them as choices before it imports torch
COVARIANCE_MODES = ("full", "tied", "diag", "lowrank")  # what an artifact can hold
COVARIANCE_CHOICES = ("auto", *COVARIANCE_MODES)  # what `covariance` accepts
