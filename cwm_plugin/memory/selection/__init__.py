"""What a prompt carries from memory: ranked lines packed under a budget."""
