"""Class-conditional Gaussians of the features, in torch only: streaming moments
(moments.py), the fitted means and precision factors (gaussians.py), and the Mahalanobis
distances to them (distances.py). Start with gaussians.py."""
