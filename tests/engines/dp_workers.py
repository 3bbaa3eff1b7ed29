"""Stand-ins for the dock's handles in the data-parallel tests: a worker's ``forward_into`` reads its rows from a
reader and writes its output through slots; these hold the rows themselves and hand back what was written
(picklable, so they reach the rank processes); and the prompt-grouped rows those tests cut over ranks."""

from __future__ import annotations

from typing import Callable

import torch

from relayrl.engines.training.base import SequenceBatch


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


def grouped_rows(tok, groups: list[tuple[int, ...]], seed: int, prompt: Callable[[int], str]) -> SequenceBatch:
    """A batch of prompt groups: group ``k`` holds one row per length in ``groups[k]``, random response ids of that
    length behind the prompt ``prompt(k)``."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, ids = [], [], []
    for k, lengths in enumerate(groups):
        p = torch.tensor(tok(prompt(k))["input_ids"])
        for n in lengths:
            prompts.append(p)
            responses.append(torch.randint(5, 200, (n,), generator=g))
            ids.append(k)
    return SequenceBatch(prompts, responses, {}, groups=ids)

