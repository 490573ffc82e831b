"""HTTP plumbing every part of the sidecar shares: OpenAI-shaped errors, bounded JSON bodies."""
