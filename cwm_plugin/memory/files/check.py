"""``cwm memory check``: what in a memory root would be skipped when read.

Memory is file-first and people may edit the files, so reading never fails on a damaged line:
a memory line that does not parse is skipped, a damaged summary header is ignored, bytes of a
session file outside complete turn records are passed over. This lists each of them, with
paths relative to the root, so someone can fix the files (then ``cwm memory reindex``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cwm_plugin.memory.files.markdown import SUMMARY_MARK, MemoryFiles, decode_turns, encode_turn
from cwm_plugin.memory.files.markdown import summary_meta as _summary_meta


@dataclass
class Problem:
    path: str  # relative to the memory root
    line: int | None
    what: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.what}"


def check_folder(files: MemoryFiles, folder: str) -> list[Problem]:
    out: list[Problem] = []
    base = files.folder_dir(folder)
    _, bad = files.scan_memories(folder)
    for n, line in bad:
        out.append(Problem(f"{folder}/memories.md", n, "not a valid memory line (skipped): "
                                                       + line[:80]))
    for session in files.sessions(folder):
        path = files.session_path(folder, session)
        data = path.read_bytes()
        covered = sum(len(encode_turn(t)) for t in decode_turns(data))
        if covered != len(data):
            out.append(Problem(str(path.relative_to(files.root)), None,
                               f"{len(data) - covered} bytes outside complete turn records "
                               "(skipped: garbled, edited or torn by a crash)"))
    summaries = base / "summaries"
    for path in sorted(summaries.glob("*.md")) if summaries.is_dir() else []:
        head = path.read_text(encoding="utf-8", errors="replace").partition("\n")[0]
        if head.startswith(SUMMARY_MARK) and _summary_meta(head) is None:
            out.append(Problem(str(path.relative_to(files.root)), 1,
                               "damaged summary header (ignored: the summary is redone)"))
    return out


def check(files: MemoryFiles, folder: str | None = None) -> list[Problem]:
    """Every problem of one folder's files, or of every folder's."""
    folders = [folder] if folder else files.folders()
    return [p for t in folders for p in check_folder(files, t)]
