"""Tables that fit the terminal: rich (colours for statuses) on a terminal, plain text otherwise.

At a width too narrow for every column, the optional columns go first, in order; the others
(names, ids, statuses, URLs) are never dropped or split, except prose (REASON), which wraps
between words. If it still does not fit, each row is printed as a block of lines.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Collection, Sequence

# Prose columns: wrapped between words, never narrower than _WRAP_MIN when the table must fit.
_WRAPS = frozenset({"REASON"})
_WRAP_MIN = 16
# Characters a table spends around its cells: (between two columns, at the two edges).
_PLAIN_GAPS = (2, 0)
_RICH_GAPS = (3, 2)


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int] | None = None) -> str:
    """Columns padded to their widest cell, two spaces apart; no trailing spaces.

    With `widths`, a cell wider than its column is wrapped between words onto the next lines.
    """
    natural = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    widths = list(widths or natural)
    lines = []
    for row in (headers, *rows):
        cells = [_wrap(cell, w) if len(cell) > w else [cell] for cell, w in zip(row, widths, strict=True)]
        for n in range(max(len(c) for c in cells)):
            parts = [(c[n] if n < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
            lines.append("  ".join(parts).rstrip())
    return "\n".join(lines) + "\n"


def rich_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, width: int = 160, wraps: Collection[str] = ()
) -> str:
    """The same table drawn by rich (colours for statuses), as text for a terminal."""
    import rich.console
    import rich.table

    table = rich.table.Table(title=title, title_justify="left", show_edge=False, header_style="bold")
    for h in headers:
        if h in wraps:
            table.add_column(h, overflow="fold")
        else:
            table.add_column(h, no_wrap=True, overflow="ignore")
    for row in rows:
        table.add_row(*(_colour(headers[i], cell) for i, cell in enumerate(row)))
    buf = io.StringIO()
    rich.console.Console(file=buf, force_terminal=True, width=width).print(table)
    return buf.getvalue()


_GOOD = {"READY"}
_BAD_PREFIX = ("FAILED", "UNKNOWN", "CONTROLLER_FAILED", "PREEMPTED")


def _colour(header: str, cell: str) -> str:
    if header != "STATUS":
        return cell.replace("[", "\\[")
    if cell in _GOOD:
        return f"[green]{cell}[/green]"
    if cell.startswith(_BAD_PREFIX):
        return f"[red]{cell}[/red]"
    return f"[yellow]{cell}[/yellow]"


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(1, width), break_on_hyphens=False) or [""]


def _fit(
    headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, gaps: tuple[int, int], optional: Sequence[str]
) -> list[int] | None:
    """The columns to show at `width` (indexes), or None when even the kept ones do not fit."""
    natural = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def need(shown: list[int]) -> int:
        cells = sum(min(natural[i], _WRAP_MIN) if headers[i] in _WRAPS else natural[i] for i in shown)
        return cells + gaps[0] * (len(shown) - 1) + gaps[1]

    shown = list(range(len(headers)))
    for name in optional:
        if need(shown) <= width:
            break
        shown = [i for i in shown if headers[i] != name]
    return shown if need(shown) <= width else None


def _blocks(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> str:
    """Each row as a block of `  HEADER  value` lines; a value too long for that line goes whole
    on a line of its own (prose is wrapped between words)."""
    label = max(len(h) for h in headers)
    lines = [title]
    for n, row in enumerate(rows):
        if n:
            lines.append("")
        for header, cell in zip(headers, row, strict=True):
            if 4 + label + len(cell) <= width:
                lines.append(f"  {header.ljust(label)}  {cell}")
            elif header in _WRAPS:
                lines += [f"  {header}"] + [f"    {part}" for part in _wrap(cell, width - 4)]
            else:
                lines += [f"  {header}", f"    {cell}"]
    return "\n".join(lines) + "\n"


def table(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    tty: bool,
    width: int | None = None,
    optional: Sequence[str] = (),
) -> str:
    """A titled table: rich on a terminal, plain text otherwise (pipes, files, CI).

    At a `width` too narrow for every column, the `optional` ones are left out first, in
    order; the others are never split (prose in REASON wraps between words).
    """
    shown = list(range(len(headers)))
    if width is not None:
        fitted = _fit(headers, rows, width, _RICH_GAPS if tty else _PLAIN_GAPS, optional)
        if fitted is None:
            return _blocks(title, headers, rows, width)
        shown = fitted
    headers = [headers[i] for i in shown]
    rows = [[row[i] for i in shown] for row in rows]
    if tty:
        natural = sum(max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers))
        return rich_table(title, headers, rows, width=width or natural + 3 * len(headers), wraps=_WRAPS)
    if width is None:
        return f"{title}\n" + plain_table(headers, rows)
    return f"{title}\n" + plain_table(headers, rows, _plain_widths(headers, rows, width))


def _plain_widths(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    natural = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    wrapping = [i for i, h in enumerate(headers) if h in _WRAPS]
    spare = width - sum(w for i, w in enumerate(natural) if i not in wrapping) - _PLAIN_GAPS[0] * (len(headers) - 1)
    for i in wrapping:
        natural[i] = max(min(natural[i], spare // len(wrapping)), min(natural[i], _WRAP_MIN))
    return natural
