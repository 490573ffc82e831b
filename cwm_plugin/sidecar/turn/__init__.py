"""One chat turn (its route: ``api/chat.py``): what is sent upstream (``plan.py``,
``prompt.py``, ``budget.py``, counted with ``counting.py``), the session's state between turns
(``session.py``), the memory it draws on (``memory_port.py``, failing
open: ``failopen.py``) and what a turn leaves for context windows (``records.py``)."""
