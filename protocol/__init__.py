"""Abstract Play real-time protocol: messages, parsing and codecs, with no I/O."""
