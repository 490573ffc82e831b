"""The Redis tier: blobs and their key index shared by every server."""
