"""The method, in torch only: class-conditional Gaussians, distances, losses, the
feature hook, test-time normalisation, the methods (methods/, one file each behind the
protocol in methods/base.py) and the online Adapter. Nothing here reads a settings
object or names a command-line flag, so it can be lifted into any loop.
Start with reference.py."""
