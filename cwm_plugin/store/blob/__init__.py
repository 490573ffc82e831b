"""The blob format: container and header, codec (tensor <-> bytes), encryption, content ids."""
