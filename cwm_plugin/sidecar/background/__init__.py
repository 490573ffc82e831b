"""Work after the answer has gone out: the bounded per-session queue (``queue.py``) and what
runs on it -- running summaries, fact extraction, checkpoints (``maintainer.py``) -- with the
prompts the model is given (``prompts.py``)."""
