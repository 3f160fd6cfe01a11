"""Abstract Play real-time server: the I/O around the sans-I/O ``protocol`` core."""

__version__ = "0.2.0"
"""The release: ``ap-realtime --version``, the package and the image label (CHANGELOG.md)."""
