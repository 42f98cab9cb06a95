"""What a sequence's decode steps read: pages (KV blocks) per KV head and layer, summed over its steps."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class DecodeStats:
    """steps: decode steps taken. pages_visible: pages a dense step would have read (every entry of the sequence's
    table, per KV head and layer); pages_read: the pages its policy's attention read for the current token;
    pages_corrected: pages a RetroAttention step attended for past tokens that had not seen them (each a page
    read for the current token and reused, not a second read from memory). Under retrieval, pages_read counts the
    static set's pages."""

    steps: int = 0
    pages_visible: int = 0
    pages_read: int = 0
    pages_corrected: int = 0
    keys_scanned: int = 0            # retrieval: keys its CPU index searches scored, over layers and query heads
    retrieval_seconds: float = 0.0   # retrieval: wall time of those searches and their attention, per step summed
    table_pages: int = 0   # entries of its prefill tables summed over layers (set when it starts decoding)

    def visible(self, seq, num_layers: int, kv_heads: int) -> int:
        """The pages a dense step of ``seq`` reads now: its tables' and its generated blocks' at every layer."""
        return kv_heads * (self.table_pages + num_layers * len(seq.gen_blocks))

    def add(self, visible: int, read: int, corrected: int = 0) -> None:
        self.steps += 1
        self.pages_visible += visible
        self.pages_read += read
        self.pages_corrected += corrected

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["table_pages"]
        return out
