"""The RAM tier: an LRU of blobs in this process."""
