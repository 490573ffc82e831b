"""The blob format: the container and its header, the codec (tensor <-> bytes), encryption at rest, content addresses."""
