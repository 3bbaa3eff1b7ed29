"""A run config's problems as its run loads them, and the run's length from them.

:class:`RunProblems` resolves the model directory and tokenizer, then the problems: a built-in task (which
draws fresh ones without end), or a dataset's training rows and held-out rows, each fitted to the model's
context. It is the data part of every session (:class:`~relayrl.workflows.heldout.EvalSession` for
``relayrl eval --recipe``, :class:`~relayrl.workflows.session.Session` for a training run) and is what
``relayrl plan --length-growth`` loads to count a ``trainer.total_epochs`` recipe's steps
(:func:`resolve_steps`), so the planner counts the rows the run will train on::

    model_path, tokenizer    <- trainer.init_from > model.path > the tiny default
    task, or training rows   <- data.task, or data.path / data.hf_name
    held-out problems        <- the task's eval set, data.eval_path, or eval.size rows carved out of the
                                training rows with run.seed (workflow kto: out of its desirable rows)
    env.tools_in_prompt      -> the tools in each chat prompt's template (before lengths are measured)
    training rows (training) -> fitted (data.max_prompt_tokens, the context beside rollout.max_new_tokens;
                                data.long_prompts=drop leaves the long ones out)
    held-out problems        -> fitted beside eval.max_new_tokens (or rollout.max_new_tokens)
    training rows (training) -> data.max_rows of them
    trainer.steps            <- trainer.total_epochs passes over the training rows (resolved_steps)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from relayrl.config.schema import Config
from relayrl.config.trainer import resolve_total_epochs
from relayrl.data.tasks import Problem, make_task
from relayrl.models.load import check_model_dir, load_tokenizer
from relayrl.models.tiny import build_tiny

__all__ = ["RunProblems", "resolve_steps", "resolve_model_path", "first_rows", "raw_answers"]


def resolve_model_path(cfg: Config) -> Path:
    """``trainer.init_from`` > ``model.path`` > the tiny default (built and cached on first use)."""
    for key, value in (("trainer.init_from", cfg.trainer.init_from), ("model.path", cfg.model.path)):
        if value:  # (checked here, not in each worker that loads the weights)
            return check_model_dir(value, key, f"{key}={value}")
    return build_tiny(cfg.model.tiny)


def first_rows(rows: list, n: int, *, seed: int, shuffle: bool) -> tuple[list, str | None]:
    """``data.max_rows``: ``n`` of ``rows``, in their order: a sample drawn with ``seed`` (``shuffle``) or the
    first ``n``; and the line that says so (None, and ``rows`` itself, when there are no more than ``n``)."""
    if len(rows) <= n:
        return rows, None
    keep = sorted(random.Random(seed).sample(range(len(rows)), n)) if shuffle else range(n)
    how = "drawn with run.seed" if shuffle else "the first ones (data.shuffle=false)"
    return [rows[i] for i in keep], f"data.max_rows={n}: training on {n:,} of {len(rows):,} rows, {how}"


def response_budget(cfg: Config, turn: int, key: str) -> tuple[int, str]:
    """The tokens generated after a prompt, and the key that sets them: ``turn`` (``key``), or with episodes
    (``env.name``) ``env.max_tokens``, the whole response of turns and observations (``turn`` caps one turn)."""
    if cfg.env.enabled:
        return cfg.env.max_tokens, "env.max_tokens"
    return turn, key


class RunProblems:
    """The model directory, tokenizer and problems of ``cfg`` (module docstring). ``training``: also fit the
    training rows and take ``data.max_rows`` of them, as a training run does (an evaluation only reads them
    for their fields). Lines about the rows (held out, dropped, sampled) go to ``log``."""

    def __init__(self, cfg: Config, *, training: bool, log: Callable[[str], None] = print) -> None:
        self.cfg, self.log = cfg, log
        self.model_path = resolve_model_path(cfg)
        self.tokenizer = load_tokenizer(self.model_path, chat_template=cfg.model.template())
        self._encode_cache: dict[str, list[int]] = {}
        self.task, self.train_problems, self.eval_problems = self._data()
        """``train_problems``: a dataset's training rows (None for a built-in task, which draws fresh ones)."""
        self._describe_tools(self.train_problems)
        if training and self.train_problems is not None and cfg.data.messages_key is not None:
            from relayrl.data.chat import check_conversations  # (each row's loss mask, before any work starts)

            check_conversations(self.tokenizer, self.train_problems, cfg.data.chat_template_kwargs)
        if training and self.train_problems is not None:  # (against the context too when the rows are generated
            # from: grpo; the rows left out are gone before the prompt source is built, so a resumed run walks the
            # same rows)
            budget, key = response_budget(cfg, cfg.rollout.max_new_tokens, "rollout.max_new_tokens")
            self.train_problems = self._fit(self.train_problems, "training", budget if cfg.workflow == "grpo"
                                            else None, key)
            self.train_problems = self._fit_answers(self.train_problems)
        self._check_lengths()
        self._check_turn_end()
        if training and self.train_problems is not None and cfg.data.max_rows is not None:
            self.train_problems, line = first_rows(self.train_problems, cfg.data.max_rows, seed=cfg.run.seed,
                                                   shuffle=cfg.data.shuffle)
            if line is not None:
                log(f"relayrl: {line}")
        if training and self.train_problems is not None and cfg.workflow == "grpo" \
                and 0 < len(self.train_problems) < cfg.data.prompts_per_step:
            log(f"relayrl: warning: data.prompts_per_step={cfg.data.prompts_per_step} is more than the "
                f"{len(self.train_problems)} training rows: every step repeats prompts (its groups of one prompt "
                f"are not independent samples); lower data.prompts_per_step or give more rows")

    def resolved_steps(self) -> tuple[Config, str | None]:
        """The config with ``trainer.total_epochs`` turned into ``trainer.steps`` over the training rows, and
        the line that says so (:func:`relayrl.config.trainer.resolve_total_epochs`; the config itself and
        None when ``total_epochs`` is not set)."""
        return resolve_total_epochs(self.cfg, len(self.train_problems or ()))

    # ------------------------------------------------------------------ data
    def _data(self) -> tuple[object, list[Problem] | None, list[Problem]]:
        """(the task or None, a dataset's training rows or None, the held-out problems)."""
        from relayrl.data.datasets import load_problems

        d = self.cfg.data
        if d.task is not None:
            task = make_task(d.task, **d.task_options)
            eval_task = make_task(d.task, **{**d.task_options, **(d.eval_task_options or {}), "eval_size": self.cfg.eval.size})
            return task, None, eval_task.eval_set()
        rejected = d.rejected_key if self.cfg.workflow in ("dpo", "rm") else None  # preference pairs, every row checked
        kto = self.cfg.workflow == "kto"  # labelled rows, every label checked; only desirable answers are scored
        label = d.label_key if kto else None
        raw = raw_answers(self.cfg)
        train = _named(load_problems, d.dataset(rejected_key=rejected, label_key=label, raw_answers=raw), "data.path")
        size = self.cfg.eval.size
        held_out = d.eval_datasets(rejected_key=rejected if self.cfg.workflow == "rm" else None, label_key=label,
                                   raw_answers=raw)
        if held_out:  # each held-out set's first eval.size rows (verl's data.val_files list)
            return None, train, [p for i, ds in enumerate(held_out) for p in self._held_out(ds, i, len(held_out), kto)]
        pool, kind = _scorable(train, kto), " labelled desirable" if kto else ""
        if len(pool) >= 2 * size:  # hold out a seeded sample of the rows evaluation scores; train on the rest
            held = set(random.Random(self.cfg.run.seed).sample(pool, size))
            of = f"{len(pool)} rows{kind} (the rows kto scores; {len(train)} in all)" if kto else f"{len(train)} rows"
            self.log(f"relayrl: no data.eval_path; holding out {size} of {of} of {d.path or d.hf_name} for evaluation")
            return None, [p for i, p in enumerate(train) if i not in held], _scored([train[i] for i in sorted(held)], kto)
        self.log(f"relayrl: no data.eval_path and only {len(pool)} rows{kind} in {d.path or d.hf_name}: evaluating on "
                 f"the first {min(size, len(pool))} training rows{kind} (not held out); set data.eval_path for a "
                 f"held-out score")
        return None, train, _scored(train, kto)[:size]

    def _held_out(self, ds, i: int, of: int, kto: bool = False) -> list[Problem]:
        """The first ``eval.size`` scored rows of held-out set ``ds`` (kto: its desirable rows), item ``i`` of
        ``of`` (an error names the item of a data.eval_path list)."""
        from relayrl.data.datasets import DatasetError, load_problems

        try:
            return _scored(load_problems(ds) if of > 1 else _named(load_problems, ds, "data.eval_path"),
                           kto)[: self.cfg.eval.size]
        except DatasetError as e:
            if of == 1:
                raise
            raise DatasetError(f"data.eval_path item {i} ({ds.path}): {e}") from None

    def _describe_tools(self, train: list[Problem] | None) -> None:
        """``env.tools_in_prompt``: the tool environment's tools go into each chat prompt's template, in its
        ``tools`` list (as TRL renders them), so an instruct model knows what it may call."""
        env = self.cfg.env
        chats = [p for p in (*(train or ()), *self.eval_problems) if "messages" in p.meta]
        if env.name != "tools" or not env.tools_in_prompt or not chats:
            return
        from relayrl.environments.config import load_tools
        from relayrl.environments.tools import tool_schema

        if "tools" not in str(getattr(self.tokenizer, "chat_template", None) or ""):
            self.log(f"relayrl: env.tools_in_prompt: the chat template of {self.model_path} has no tools list, so "
                     f"the prompts do not describe the tools; describe them in data.system_prompt (or set "
                     f"env.tools_in_prompt=false to silence this)")
            return
        schemas = [tool_schema(t) for t in load_tools(env.tools, env.sandbox).values()]
        for p in chats:
            p.meta["tools"] = schemas

    def _check_turn_end(self) -> None:
        """Warn when chat prompts are rendered with a template whose turns end on a special token the rollout
        does not stop at (:func:`relayrl.data.chat.unstopped_turn_end`)."""
        d = self.cfg.data
        rows = [*(self.train_problems or ()), *self.eval_problems]
        chat = d.chat_template is True or (d.chat_template is None and any("messages" in p.meta for p in rows))
        if chat:
            from relayrl.data.chat import unstopped_turn_end
            from relayrl.models.eos import checkpoint_generation_config, config_eos_ids

            eos = config_eos_ids(checkpoint_generation_config(self.model_path))  # (the engines stop there too)
            line = unstopped_turn_end(self.tokenizer, d.chat_template_kwargs, self.cfg.rollout.stop_strings, eos)
            if line is not None:
                self.log(line)

    def _check_lengths(self) -> None:
        """Refuse (or with ``data.long_prompts=drop`` leave out) a held-out row longer than
        ``data.max_prompt_tokens`` or whose prompt plus the tokens generated after it exceed the model's
        ``max_position_embeddings`` (positions past it were never trained); a training session fits its
        training rows first. ``relayrl eval --task/--data`` applies the same context check
        (:func:`relayrl.data.lengths.fit_prompts`, ``--long-prompts drop``)."""
        e = self.cfg.eval
        key = "eval.max_new_tokens" if e.max_new_tokens else "rollout.max_new_tokens"
        budget, key = response_budget(self.cfg, e.max_new_tokens or self.cfg.rollout.max_new_tokens, key)
        self.eval_problems = self._fit(self.eval_problems, "held-out", budget, key)

    def _fit(self, problems: list[Problem], what: str, budget: int | None, key: str) -> list[Problem]:
        """The ``what`` rows that fit ``data.max_prompt_tokens`` and the model's context (``rollout.vllm.max_model_len``
        where it is shorter: vLLM would end a longer one early, as cut) beside ``budget`` new tokens (None: the
        rows are not generated from), as :func:`relayrl.data.lengths.fit_prompts` keeps them."""
        from relayrl.data.lengths import PromptRoom, context_limit, fit_prompts

        d, limit, limit_key = self.cfg.data, context_limit(self.model_path), ""
        spec = self.cfg.rollout.vllm_spec()  # (vLLM ends a request at its max_model_len, before the budget)
        if spec is not None and spec.max_model_len is not None and (limit is None or spec.max_model_len < limit):
            limit, limit_key = spec.max_model_len, "rollout.vllm.max_model_len"
        room = PromptRoom(max_tokens=d.max_prompt_tokens, budget=budget, key=key, limit=limit,
                          model=self.model_path, limit_key=limit_key)
        return fit_prompts(problems, self.encode, room, drop=d.long_prompts == "drop", what=what, log=self.log)

    def _fit_answers(self, problems: list[Problem]) -> list[Problem]:
        """The training rows whose prompt and trained answer (the longer of a pair) with its EOS fit the model's
        context, for the workflows that train on a dataset's answers (:func:`relayrl.data.lengths.fit_whole`; a
        conversation row is measured whole by its own check)."""
        from relayrl.data.lengths import context_limit, fit_whole

        limit = context_limit(self.model_path)
        if self.cfg.workflow == "grpo" or self.cfg.data.messages_key is not None or limit is None:
            return problems

        def tokens(p: Problem) -> int:
            answers = [a for a in (p.answer, p.meta.get("rejected")) if isinstance(a, str)]
            return len(self.encode(p)) + 1 + max(
                (len(self.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers), default=0)
        return fit_whole(problems, [tokens(p) for p in problems], limit, self.model_path,
                         drop=self.cfg.data.long_prompts == "drop", log=self.log)

    def encode(self, problem: Problem) -> list[int]:
        """Prompt token ids (chat template applied to chat-message prompts), cached by what decides them (the text,
        and the messages and tools of a chat row: :func:`~relayrl.data.prompts.prompt_identity`)."""
        from relayrl.data.prompts import encode_prompt, prompt_identity

        key = prompt_identity(problem)
        ids = self._encode_cache.get(key)
        if ids is None:
            ids = self._encode_cache[key] = list(encode_prompt(self.tokenizer, problem, self.cfg.data.chat_template,
                                                               self.cfg.data.chat_template_kwargs))
        return ids


def resolve_steps(cfg: Config, *, log: Callable[[str], None] = print) -> tuple[Config, str | None]:
    """``cfg`` with ``trainer.total_epochs`` turned into ``trainer.steps`` over the training rows a run of ``cfg``
    loads (:class:`RunProblems`, as the run loads them: held-out rows carved out, long prompts dropped,
    ``data.max_rows``), and the line that says so; ``cfg`` itself and None, loading nothing, when
    ``total_epochs`` is not set. Raises what loading the model or the rows raises (a
    :class:`~relayrl.data.errors.DatasetError`, a :class:`~relayrl.config.loader.ConfigError`)."""
    if cfg.trainer.total_epochs is None:
        return cfg, None
    return RunProblems(cfg, training=True, log=log).resolved_steps()


def raw_answers(cfg: Config) -> bool:
    """Whether ``cfg``'s answers are only ground truths for its user reward functions (workflow grpo,
    ``reward.verifier=user``), so that they are read as the file holds them (a list or dict too:
    :class:`~relayrl.data.truth.GroundTruth`); every other run compares or trains on their text."""
    return cfg.workflow == "grpo" and cfg.reward.verifier == "user"


def _scorable(problems: list[Problem], kto: bool) -> list[int]:
    """The indexes of the rows a held-out evaluation scores, from which rows are held out: every row, or for
    workflow kto the rows labelled desirable (a sample of all rows can hold out none of them, and then nothing
    is scored); every row when none is (:func:`_scored` then refuses the held-out rows, saying what to give)."""
    good = [i for i, p in enumerate(problems) if not kto or p.meta.get("label", True)]
    return good or list(range(len(problems)))


def _scored(problems: list[Problem], kto: bool) -> list[Problem]:
    """The held-out problems whose answer is a ground truth to score against: for workflow kto the rows
    labelled desirable (an undesirable completion is no answer to reach)."""
    if not kto:
        return problems
    good = [p for p in problems if p.meta.get("label", True)]
    if not good:
        from relayrl.data.errors import DatasetError

        raise DatasetError(f"workflow kto evaluates greedy accuracy against the held-out rows labelled desirable, "
                           f"and none of the {len(problems)} held-out rows is: give data.eval_path rows with "
                           f"label true")
    return good


def _named(load, ds, key: str):
    """``load(ds)``; a file ``ds.path`` that is not there is refused naming ``key`` (``data.path`` and
    ``data.eval_path`` would otherwise read alike: ``dataset file X does not exist``)."""
    from relayrl.data.datasets import DatasetError

    try:
        return load(ds)
    except DatasetError as e:
        if ds.path is None or ds.hf_name is not None or Path(ds.path).exists():
            raise
        raise DatasetError(f"{key}={ds.path}: {e}") from None

