"""Game text made short and plain for a policy's context.

Interactive-fiction engines write for a terminal: a banner in ASCII art, a ``>`` prompt followed
by a status line (room name, score / moves), end-of-game boilerplate, runs of blank lines. A
character-level tiny model pays one token per character and has a few hundred positions, so
every observation goes through :func:`clean_observation`: only the lines that say something
about the game are kept, in printable ASCII, capped at a length the config chooses.
"""

from __future__ import annotations

import re
import unicodedata

#: lines that are an engine's boilerplate, not the game's (Inform 7's end of game)
BOILERPLATE = (
    re.compile(r"^\*+\s*The End\s*\*+$", re.IGNORECASE),
    re.compile(r"^You scored \d+ out of a possible \d+, in \d+ turns?\.?$", re.IGNORECASE),
    re.compile(r"^Would you like to RESTART, RESTORE a saved game, QUIT or UNDO", re.IGNORECASE),
)
#: a line with no letter or digit is art, a prompt or a rule (the TextWorld banner is all such)
_NO_WORD = re.compile(r"^[^A-Za-z0-9]*$")
#: the command prompt and the status line Inform 7 prints after it
_PROMPT = re.compile(r"^>")
ELLIPSIS = "..."


def to_ascii(text: str) -> str:
    """``text`` in printable ASCII and newlines: accents dropped (``é`` -> ``e``), curly quotes
    and dashes made plain, anything else removed."""
    text = (text.replace("\u2018", "'").replace("\u2019", "'").replace("\u201c", '"')
            .replace("\u201d", '"').replace("\u2013", "-").replace("\u2014", "-"))
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return "".join(c for c in text if c == "\n" or " " <= c <= "~")


def cap(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, ending in ``...`` when cut."""
    if max_chars < 1:
        raise ValueError(f"max_chars: must be >= 1, got {max_chars}")
    if len(text) <= max_chars:
        return text
    if max_chars <= len(ELLIPSIS):
        return text[:max_chars]
    return text[: max_chars - len(ELLIPSIS)].rstrip() + ELLIPSIS


def clean_observation(text: str, max_chars: int, drop: tuple[re.Pattern, ...] = ()) -> str:
    """The game's own lines of ``text``: without the banner (lines with no letter or digit),
    the ``>`` prompt and status line, the engine's boilerplate and any line matching ``drop``;
    lines stripped and joined by single newlines, in ASCII, capped at ``max_chars``."""
    lines = []
    for line in to_ascii(text or "").splitlines():
        line = " ".join(line.split())
        if (not line or _NO_WORD.match(line) or _PROMPT.match(line)
                or any(p.search(line) for p in BOILERPLATE + tuple(drop))):
            continue
        lines.append(line)
    return cap("\n".join(lines), max_chars)


def first_line(action: str, max_chars: int = 200) -> str:
    """The command in a model's action text: its first non-empty line, whitespace collapsed
    (an engine reads one line; a newline inside would be taken as a second command)."""
    for line in (action or "").splitlines():
        line = " ".join(line.split())
        if line:
            return line[:max_chars]
    return ""
