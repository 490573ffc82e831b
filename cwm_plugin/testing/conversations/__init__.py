"""Generated conversations with planted facts, LoCoMo's reader, prompts of their text."""
