"""The package version, in a leaf module so that code recording it imports nothing above it."""

__version__ = "0.1.0.dev0"
