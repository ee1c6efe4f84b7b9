"""Python warnings from every rank reach the console once.

Each rank records the warnings it raises instead of printing them; at each epoch end the ranks
gather them and rank 0's logger prints every distinct warning once, with the ranks that raised it,
instead of W copies of the same line (or none from the ranks that do not print).
"""
from __future__ import annotations

import warnings
from typing import Any

from common.output.logger import NullLogger
from common.parallel.context import DistContext


class WarningRelay:
    def __init__(self) -> None:
        self.pending: list[str] = []
        self.previous = warnings.showwarning
        warnings.showwarning = self._record

    def _record(self, message: Any, category: type[Warning], filename: str, lineno: int, *args: Any) -> None:
        text = f"{category.__name__}: {message} ({filename}:{lineno})"
        if text not in self.pending:
            self.pending.append(text)

    def flush(self, ctx: DistContext, log: NullLogger) -> None:
        """A collective: every rank calls it at the same point."""
        gathered: list[list[str]] = ctx.all_gather_json(self.pending)
        self.pending = []
        ranks: dict[str, list[int]] = {}
        for rank, texts in enumerate(gathered):
            for text in texts:
                ranks.setdefault(text, []).append(rank)
        for text, who in ranks.items():
            log.warn(f"warning (rank{'s' if len(who) > 1 else ''} {','.join(map(str, who))}): {text}")

    def close(self) -> None:
        warnings.showwarning = self.previous
