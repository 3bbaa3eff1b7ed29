"""The ``data`` section of a run's config: a built-in task, or a user dataset (a file, a ``datasets``
directory or Arrow file, or a dataset name) with the fields that hold the prompt and the answer."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.config.paths import LocalPath
from relayrl.data.dataset_config import DatasetConfig

__all__ = ["DataConfig", "RENDERING_ARGS", "check_template_kwargs"]

RENDERING_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                            "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                            "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs"})
"""``apply_chat_template``'s own arguments (and the messages and tools relayrl passes): not template variables a
user sets in ``data.chat_template_kwargs``."""


def check_template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` if every name is one a template can read and none is :data:`RENDERING_ARGS`; else a ValueError
    naming it (``data.chat_template_kwargs``, ``relayrl eval --chat-template-kwargs``)."""
    for name in value:
        if not name.isidentifier():
            raise ValueError(f"{name!r} is not a name a template can read (letters, digits and _)")
        if name in RENDERING_ARGS:
            raise ValueError(f"{name!r} is set by relayrl when it renders (apply_chat_template's own argument); "
                             f"drop it")
    return value


class DataConfig(BaseModel):
    """The training (and held-out) data: a built-in task or rows of a file or dataset, how prompts are built from
    them, and how many a step draws."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    task: str | None = Field("arith", description="built-in task name (arith, countdown, sort, toolsum); null when "
                             "data.path or data.hf_name is set")
    task_options: dict[str, Any] = Field(default_factory=dict, description="options of the built-in task's training set")
    eval_task_options: dict[str, Any] | None = Field(None, description="options of the held-out set (default: task_options)")
    path: LocalPath | None = Field(None, description="training prompts: a JSONL, Parquet or Arrow file, or a directory "
                             "written by datasets' save_to_disk (a Dataset, or a DatasetDict whose data.hf_split "
                             "is read)")
    hf_name: str | None = Field(None, description="training prompts from datasets.load_dataset: a hub name (e.g. "
                                "openai/gsm8k; read from the local datasets cache first, downloaded only when it is "
                                "not there and HF_HUB_OFFLINE is unset) or a local directory of data files")
    hf_config: str | None = Field(None, description="data.hf_name's configuration (e.g. main for openai/gsm8k)")
    hf_split: str = Field("train", min_length=1, description="the split that trains: of data.hf_name, or of a "
                          "DatasetDict directory at data.path")
    hf_eval_split: str | None = Field(None, min_length=1, description="the held-out split of the same source (e.g. "
                                      "test); null: data.eval_path, else rows held out of the training split")
    format: Literal["jsonl", "parquet", "arrow"] | None = Field(None, description="format of data.path and "
                                                                "data.eval_path files (null: from the file suffix)")
    eval_path: LocalPath | list[LocalPath] | None = Field(
        None, description="held-out prompts, in any form data.path takes; or a list of such paths (verl's "
        "data.val_files), e.g. [gsm8k/test.parquet, math500/test.parquet]: each held-out set gives its first "
        "eval.size rows, and every eval metric is also reported per source as eval/<metric>/<source> (the "
        "row's data_source field, else the file's stem; docs/metrics.md)")
    prompt_key: str = Field("prompt", description='field with the prompt (text, or chat messages); dots reach nested '
                            'fields ("extra.question")')
    answer_key: str = Field("answer", description="field with the ground truth (string or number; with "
                            "reward.verifier=user in workflow grpo also a list or dict, passed as it is)")
    answer_regex: str | None = Field(None, description="cut the ground truth out of the answer field: the regex's "
                                     r"first group (or whole match), e.g. '####\s*(.+)$' for GSM8K's solutions; a row "
                                     "without a match is an error naming it. Workflows dpo and rm cut the rejected "
                                     "answer (data.rejected_key) the same way, so both sides of a pair train as cut "
                                     "(a rejected answer without a match is refused too, and a pair whose two cut "
                                     "answers agree is refused); sft and kto train on the cut completion")
    system_prompt: str | None = Field(None, description="a system message put before every prompt (text prompts "
                                      "become chat messages, rendered with the tokenizer's chat template); a chat "
                                      "prompt with its own system message keeps it")
    rejected_key: str = Field("rejected", description="workflow dpo: field with the rejected answer (answer_key "
                              "holds the chosen one)")
    label_key: str = Field("label", description="workflow kto: field labelling each row's completion (answer_key) "
                           "desirable (true) or undesirable (false), TRL's unpaired format; a row without a "
                           "boolean-like label (true/false, 1/0, 'true'/'false') is an error naming it")
    chat_template: bool | None = Field(None, description="whether prompts are rendered with the chat template "
                                        "(the tokenizer's, or model.chat_template's): null applies it to chat-message "
                                        "prompts only; true to every prompt (a text prompt becomes one user message); "
                                        "false to none (the prompt field's text as it is)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="more variables for the chat template wherever it renders the run's "
        "chat prompts, SFT conversations and tool messages (TRL's chat_template_kwargs, verl's "
        "data.apply_chat_template_kwargs), e.g. {enable_thinking: false} for Qwen3's template; names a template "
        "does not read change nothing")
    messages_key: str | None = Field(None, description="workflow sft on data.path: field with whole conversations "
                                     "(chat messages); only the assistant turns are trained (mask from the chat "
                                     "template)")
    max_prompt_tokens: int | None = Field(None, ge=1, description="the longest prompt a row of data.path or "
                                          "data.hf_name may hold, in tokens as the run encodes it (chat template and "
                                          "data.system_prompt applied), in the training and the held-out set; "
                                          "data.long_prompts says what happens to a longer one (null: no limit "
                                          "but the model's context)")
    long_prompts: Literal["fail", "drop"] = Field("fail", description="a prompt longer than data.max_prompt_tokens, "
                                                  "or too long for the model's max_position_embeddings beside the "
                                                  "tokens generated after it: fail refuses the run before it "
                                                  "generates, naming the first such row; drop leaves those rows out "
                                                  "of the training and held-out sets before training starts (a line "
                                                  "says how many), and without data.max_prompt_tokens drops only "
                                                  "the prompts the context cannot hold. A prompt is never cut "
                                                  "(verl's data.truncation): a cut question can change its answer")
    max_rows: int | None = Field(None, ge=1, description="train on at most this many rows of data.path or "
                                 "data.hf_name (verl's data.train_max_samples): a subset drawn with run.seed, or "
                                 "with data.shuffle=false the first rows in the file's order; counted after "
                                 "data.long_prompts=drop and the held-out rows (a line says how many of how many); "
                                 "null: every row")
    shuffle: bool = Field(True, description="walk the training rows of data.path or data.hf_name in a fresh order "
                          "drawn with run.seed each epoch (verl's data.shuffle); false: in the file's order, every "
                          "epoch")
    retire_solved: float | None = Field(
        None, gt=0, le=1, description="workflow grpo on data.path or data.hf_name: retire a training row for the "
        "rest of the run once a step's group of responses to it reaches this pass rate (the share of the group "
        "whose score, before any shaping, is >= data.retire_score), e.g. 0.9: ScaleRL's no-positive-resampling "
        "and POLARIS's removal of easy prompts. A retired row is skipped in the rest of the epoch and in every "
        "later one (data/retired, data/active_rows); the run stops early, checkpointed and exported, once every "
        "row is retired. null: every row stays")
    retire_score: float = Field(
        1.0, allow_inf_nan=False, description="data.retire_solved: the score (the reward's, before any shaping) "
        "from which a response counts as solved in its group's pass rate. 1.0 is what train/accuracy and "
        "eval/accuracy count as correct with the built-in verifiers; set it for a reward in another range (a "
        "user function's partial credit, a reward model's scores), e.g. 0.5; any finite number. train/accuracy "
        "keeps counting scores >= 1.0. Read only with data.retire_solved")
    prompts_per_step: int = Field(8, ge=1, description="workflow grpo: prompts an RL step draws, each answered "
                                  "rollout.n times (refused in the others: sft, dpo, kto and rm take "
                                  "trainer.batch_size)")

    @field_validator("chat_template_kwargs", mode="after")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(value)

    @field_validator("eval_path", mode="after")
    @classmethod
    def _eval_paths(cls, value: str | list[str] | None) -> str | list[str] | None:
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("is an empty list; give one held-out path, a list of them, or null")
        for i, path in enumerate(value):
            if not path.strip():
                raise ValueError(f"item {i} is empty; give a file or directory")
            if path in value[:i]:
                raise ValueError(f"lists {path!r} twice (items {value.index(path)} and {i})")
        return value[0] if len(value) == 1 else value

    @property
    def eval_paths(self) -> list[str]:
        """``data.eval_path`` as a list: [] when unset, one path, or the paths of a list."""
        if self.eval_path is None:
            return []
        return [self.eval_path] if isinstance(self.eval_path, str) else list(self.eval_path)

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        given = [k for k in ("task", "path", "hf_name") if getattr(self, k) is not None]
        if not given:
            raise ValueError("set data.task (a built-in task), data.path (a JSONL/Parquet/Arrow file or a datasets "
                             "save_to_disk directory) or data.hf_name (a datasets name)")
        if len(given) > 1:
            drop = "data.task=null" if "task" in given else "one of them to null"
            also = (" and, unless the recipe sets another, a reward.verifier for the rows (math, exact or user: the "
                    "default, task, is the built-in task's checker); data.task=null drops the task's data.task_options"
                    if "task" in given else "")
            raise ValueError(f"{' and '.join(f'data.{k}' for k in given)} are both set; set {drop} to train on "
                             f"data.{given[-1]}{also}")
        if self.task is None:  # (a recipe or override setting data.task=null drops its base's task options)
            for key, options in (("data.task_options", self.task_options),
                                 ("data.eval_task_options", self.eval_task_options)):
                if options:
                    source = "data.path" if self.path is not None else "data.hf_name"
                    raise ValueError(f"{key}={options} are options of a built-in task, and data.task is null (the "
                                     f"data comes from {source}), so nothing reads them: drop {key} (set it to "
                                     f"{{}} or null), or set data.task to the task they are for")
        if self.hf_name is not None:
            from relayrl.data.hf import INSTALL_HINT, datasets_installed

            if not datasets_installed():
                raise ValueError(f"data.hf_name={self.hf_name!r} is read with Hugging Face datasets, which is not "
                                 f"installed: {INSTALL_HINT}")
        if self.hf_eval_split is not None and self.eval_path is not None:
            raise ValueError("data.hf_eval_split and data.eval_path both name a held-out set; set one to null")
        if self.hf_eval_split is not None and self.task is not None:
            raise ValueError("data.hf_eval_split is a split of data.path or data.hf_name; a built-in task holds out "
                             "its own (data.eval_task_options): drop data.hf_eval_split")
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ValueError(f"data.answer_regex={self.answer_regex!r} is not a regular expression ({e})") from None
        if self.task is not None and (self.max_prompt_tokens is not None or self.long_prompts == "drop"):
            given, fix = (("data.max_prompt_tokens", "unset it") if self.max_prompt_tokens is not None
                          else ("data.long_prompts=drop", "set data.long_prompts=fail"))
            raise ValueError(f"{given} measures the rows of a dataset (data.path or data.hf_name); the built-in "
                             f"task data.task={self.task!r} draws fresh prompts, whose size data.task_options sets: "
                             f"{fix}")
        if self.chat_template is False and self.chat_template_kwargs:
            raise ValueError(f"data.chat_template_kwargs={self.chat_template_kwargs} are for the chat template, "
                             f"which data.chat_template=false never applies: drop one of them")
        if self.task is not None and (self.max_rows is not None or not self.shuffle):
            given = f"data.max_rows={self.max_rows}" if self.max_rows is not None else "data.shuffle=false"
            raise ValueError(f"{given} picks and orders the rows of a dataset (data.path or data.hf_name); the "
                             f"built-in task data.task={self.task!r} draws fresh prompts without end: drop {given}")
        if self.retire_solved is None and self.retire_score != type(self).model_fields["retire_score"].default:
            raise ValueError(f"data.retire_score={self.retire_score:g} is the score from which a response counts as "
                             f"solved in data.retire_solved's pass rate, and data.retire_solved is null (no row is "
                             f"retired), so nothing reads it: set data.retire_solved (e.g. 0.9) or drop "
                             f"data.retire_score")
        if self.task is not None and self.retire_solved is not None:
            raise ValueError(f"data.retire_solved={self.retire_solved:g} retires the rows of a dataset (data.path or "
                             f"data.hf_name) once solved; the built-in task data.task={self.task!r} draws fresh "
                             f"prompts without end: drop data.retire_solved")
        if self.task is not None:  # an unknown task or option fails here, not after the model has loaded
            from relayrl.data.tasks import make_task, task_option_error

            for key, options in (("data.task_options", self.task_options),
                                 ("data.eval_task_options", self.eval_task_options or {})):
                if (why := task_option_error(options, key)) is not None:
                    raise ValueError(why)
            for key, options in (("data.task_options", self.task_options),
                                 ("data.eval_task_options", {**self.task_options, **(self.eval_task_options or {})})):
                try:
                    make_task(self.task, **options)
                except ValueError as e:
                    raise ValueError(f"data.task={self.task!r} with {key}={options}: {e}") from None
        return self

    def dataset(self, *, held_out: bool = False, rejected_key: str | None = None,
                label_key: str | None = None, raw_answers: bool = False) -> DatasetConfig | None:
        """The :class:`DatasetConfig` of the training rows, or of the held-out ones (None when no held-out
        source is named: data.eval_path or data.hf_eval_split). A list of held-out paths: :meth:`eval_datasets`.
        ``raw_answers``: the rows are scored by a user reward function (:class:`DatasetConfig`)."""
        if held_out:
            sets = self.eval_datasets(rejected_key=rejected_key, label_key=label_key, raw_answers=raw_answers)
            if len(sets) > 1:
                raise ValueError(f"data.eval_path lists {len(sets)} held-out sets; read them with eval_datasets()")
            return sets[0] if sets else None
        return self._dataset(self.path, self.hf_split, rejected_key, label_key, raw_answers)

    def eval_datasets(self, *, rejected_key: str | None = None, label_key: str | None = None,
                      raw_answers: bool = False) -> list[DatasetConfig]:
        """A :class:`DatasetConfig` per held-out set: each path of data.eval_path, or data.hf_eval_split of the
        training source; [] when none is named (rows of the training split are held out)."""
        if self.eval_path is not None:
            return [self._dataset(path, self.hf_split, rejected_key, label_key, raw_answers)
                    for path in self.eval_paths]
        if self.hf_eval_split is not None:
            return [self._dataset(self.path, self.hf_eval_split, rejected_key, label_key, raw_answers)]
        return []

    def _dataset(self, path: str | None, split: str, rejected_key: str | None,
                 label_key: str | None = None, raw_answers: bool = False) -> DatasetConfig:
        return DatasetConfig(
            path=path, hf_name=None if path is not None else self.hf_name, hf_config=self.hf_config, split=split,
            prompt_key=self.prompt_key, answer_key=self.answer_key, rejected_key=rejected_key, label_key=label_key,
            format=self.format, raw_answers=raw_answers,
            messages_key=self.messages_key, system_prompt=self.system_prompt, answer_regex=self.answer_regex)
