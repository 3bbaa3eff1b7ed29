"""The :class:`DatasetConfig` of a user dataset (where it is, which fields hold the prompt and the answer) and
:func:`key_options`, which maps each field it reads to the option that sets it, for errors that name the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DatasetConfig", "key_options"]


class DatasetConfig(BaseModel):
    """Where a user dataset is and which fields hold the prompt and the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path | None = Field(None, description="a .jsonl/.json/.ndjson (JSON lines, or one JSON array), .parquet or "
                              ".arrow file, or a directory datasets' save_to_disk wrote; None: hf_name")
    hf_name: str | None = Field(None, min_length=1, description="a dataset name for datasets.load_dataset (a hub "
                                "name, read from the cache first, or a local directory of data files)")
    hf_config: str | None = Field(None, min_length=1, description="the dataset's configuration (e.g. 'main')")
    split: str = Field("train", min_length=1, description="split of hf_name, or of a DatasetDict directory")
    system_prompt: str | None = Field(None, description="a system message put before every prompt (the prompt "
                                      "becomes chat messages); a chat prompt that has one keeps its own")
    answer_regex: str | None = Field(None, min_length=1, description="the answer is this regex's first group (or "
                                     "whole match) searched in the answer field, and the rejected answer the same "
                                     "in the rejected field; a row without a match is an error")
    prompt_key: str = Field("prompt", min_length=1, description='field with the prompt; dots reach nested fields ("x.prompt")')
    answer_key: str = Field("answer", min_length=1, description="field with the ground truth (string or number)")
    raw_answers: bool = Field(False, description="the rows are scored by a user reward function: a number, list, "
                              "dict or boolean answer is a GroundTruth, its text beside the value the file holds; "
                              "False: a number becomes its text, and the others are refused naming the row")
    rejected_key: str | None = Field(None, min_length=1, description="field with a rejected answer (preference "
                                     "pairs: the answer field is the chosen one); None: not read")
    label_key: str | None = Field(None, min_length=1, description="field labelling the answer desirable (true) or "
                                  "undesirable (false): unpaired preference rows (KTO), kept in meta['label']; "
                                  "None: not read")
    format: Literal["jsonl", "parquet", "arrow"] | None = Field(None, description="None: inferred from the file suffix")
    messages_key: str | None = Field(None, min_length=1, description="multi-turn SFT: field with a whole "
                                     "conversation (chat messages); prompt_key and answer_key are then not read")
    limit: int | None = Field(None, ge=1, description="keep only the first N rows")

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("give exactly one of path (a file or a save_to_disk directory) and hf_name")
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ValueError(f"answer_regex={self.answer_regex!r} is not a regular expression ({e})") from None
        return self

    @property
    def label(self) -> str:
        """How row errors name the source: the file's name, or the dataset name and split."""
        return Path(self.path).name if self.path is not None else f"{self.hf_name}[{self.split}]"


def key_options(cfg: DatasetConfig) -> dict[str, str]:
    """Each field name ``cfg`` reads, mapped to the option that sets it (``answer`` -> ``data.answer_key``): a
    missing field's error names the option to change."""
    options = {"prompt_key": cfg.prompt_key, "answer_key": cfg.answer_key, "rejected_key": cfg.rejected_key,
               "label_key": cfg.label_key, "messages_key": cfg.messages_key}
    return {key: f"data.{name}" for name, key in reversed(options.items()) if key}
