"""Response replay tables: planned output token ids per request (Dynamo mocker's format).

JSONL, one row per turn: `request_id`, `session_id`, `output_length` (alias `output_tokens`) and
`output_token_ids`. A row's key is its trimmed `request_id`, else `<session_id>:<turn>` (turns
counted per session in file order, rows without token ids still count a turn), else
`line:<N>` (0-based physical line). A request picks its row by an output-replay id.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("vllm_vcr.engine")


class ReplayTableError(ValueError):
    pass


class ResponseReplayTable:
    def __init__(self, rows: dict[str, list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, key: str) -> list[int] | None:
        return self.rows.get(key)

    @classmethod
    def from_path(cls, path: str | Path) -> "ResponseReplayTable":
        rows: dict[str, list[int]] = {}
        turns: dict[str, int] = {}
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ReplayTableError(f"failed to open response replay trace {path}: {e}") from None
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            where = f"response replay trace line {index + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReplayTableError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ReplayTableError(f"{where}: expected a JSON object")
            session = row.get("session_id")
            turn = 0
            if session is not None:
                turn = turns.get(session, 0)
                turns[session] = turn + 1
            ids = row.get("output_token_ids")
            if ids is None:
                continue
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ReplayTableError(f"{where}: output_token_ids must be a list of integers")
            length = row.get("output_length", row.get("output_tokens"))
            if length is None:
                raise ReplayTableError(f"{where} has output_token_ids but no output_length")
            if length != len(ids):
                raise ReplayTableError(
                    f"{where} output_length {length} does not match output_token_ids length {len(ids)}")
            key = replay_key(row.get("request_id"), session, turn, index)
            if key in rows:
                raise ReplayTableError(f"{where} duplicates output_replay_id key {key}")
            rows[key] = ids
        logger.info("loaded response replay token table %s: %d rows", path, len(rows))
        return cls(rows)


def replay_key(request_id: str | None, session_id: str | None, turn: int, line_index: int) -> str:
    if request_id is not None and str(request_id).strip():
        return str(request_id).strip()
    if session_id is not None:
        return f"{session_id}:{turn}"
    return f"line:{line_index}"
