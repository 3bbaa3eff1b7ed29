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
