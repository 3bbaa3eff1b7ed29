"""Stand-ins for the dock's handles in the data-parallel tests: a worker's ``forward_into`` reads its rows from a
reader and writes its output through slots; these hold the rows themselves and hand back what was written
(picklable, so they reach the rank processes)."""

from __future__ import annotations


class RowsReader:
    """The dock reader of a rank's rows: ``read()`` gives the columns."""

    def __init__(self, cols: dict[str, list]) -> None:
        self.cols = cols

    def read(self) -> dict[str, list]:
        return self.cols


class EchoSlots:
    """The dock slots of a rank's rows: ``write(columns)`` returns the columns as the receipt."""

    def write(self, columns: dict) -> dict:
        return columns


def dock_items(batch: SequenceBatch, shares: list[range | None], fields: list[str]) -> list:
    """One ``(reader, slots)`` per rank over its rows of ``batch`` (None: the driver gave it none, as a step of
    fewer prompt groups than ranks does)."""

    def cols(rows: range) -> dict:
        part = batch.select(rows)
        return {"prompt_ids": part.prompt_ids, "response_ids": part.response_ids, "group": part.groups,
                **{f: part.fields[f] for f in fields}}

    return [(None, None) if rows is None else (RowsReader(cols(rows)), EchoSlots()) for rows in shares]
