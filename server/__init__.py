"""Abstract Play real-time server: the I/O around the sans-I/O ``protocol`` core."""
