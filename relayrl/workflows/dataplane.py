"""Workers on the data plane: each reads its rows from the dock's storage units and writes its outputs back
from its own process; the driver hands it row indexes (a reader and slots), never tensors.

Seed 000's workers put into and get from the transfer dock themselves, and seed 002's clients talk to the
storage units while only metadata reaches the controllers. Here:

* the **rollout** generates with continuous batching and writes each prompt group the moment its last
  response finishes (``start_stream`` / ``poll_stream``: generation runs on a thread of the worker, the
  driver polls for the write receipts and publishes them, so later stages start on that group while the
  rest still decode);
* the **trainer-side** roles (actor, reference, critic) read a batch of rows through a reader, run their
  pass, and write the output column (``old_logprobs``, ``ref_logprobs``, ``values``) through slots,
  returning the receipt; the actor's update and its per-group accumulation read their rows the same way;
* the **scorer** (reward verifier and advantage estimator, in the driver's process) decodes and scores the
  responses and writes ``scores``/``rewards``, then ``advantages``.

Columns of a step's partition: ``prompt_ids``, ``response_ids``, ``gen_logprobs`` (per token: the behaviour
log-probs), ``token_versions`` (per token: the weight version that sampled it), ``group`` (the prompt group),
``truncated`` (cut at ``max_new_tokens``), ``version`` (the weights its first token was sampled with), then ``rewards``, ``ref_logprobs``, ``old_logprobs``, ``values``, ``advantages``, ``returns``.
Multi-turn episodes (``env.name``) add ``loss_mask`` (per token: 0 where the environment wrote) and
``env_rewards`` (the episode's reward): the rollout runs the episodes, continuously batched across turns,
and writes a group when its last episode ends; the score stage takes ``env_rewards`` for the verifier.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from typing import Any, NamedTuple, Sequence

import torch

from relayrl.cluster import Worker, compute
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.data.tasks import Problem
from relayrl.dock import Slots
from relayrl.engines.training.base import SequenceBatch
from relayrl.environments.base import Episode
from relayrl.environments.config import EpisodeSpec
from relayrl.workflows.estimate import advantage_rows
from relayrl.workflows.workers import CriticWorker, PolicyWorker, ReferenceWorker, RolloutWorker

__all__ = ["StreamingRollout", "DockPolicyWorker", "DockReferenceWorker", "DockCriticWorker",
           "ScoreWorker", "Scored", "rows_batch", "group_rows"]

_DONE = object()


def rows_batch(cols: dict[str, list], fields: Sequence[str] = (), drop_truncated: bool = False) -> SequenceBatch:
    """The rows read from the dock as a :class:`SequenceBatch` (``groups`` from the ``group`` column);
    ``drop_truncated``: without the rows cut at ``max_new_tokens`` (DAPO's overlong filter)."""
    batch = SequenceBatch(cols["prompt_ids"], cols["response_ids"], {f: cols[f] for f in fields},
                          [int(g) for g in cols["group"]])
    if drop_truncated:
        batch = batch.select([i for i, t in enumerate(cols["truncated"]) if not bool(t)])
    return batch


def group_rows(prompt: Sequence[int], group: int, comps: Sequence[Completion],
               episodes: Sequence[Episode] | None = None) -> tuple[dict[str, list], dict]:
    """The dock columns of finished samples of one prompt group (``comps``: the whole group in sample order,
    or the samples written per row) and their record for the driver (lengths, truncation, tokens per weight
    version: metadata only). Episodes (``comps[i]`` is
    ``episodes[i].completion(...)``) add ``loss_mask`` (0 on the environment's tokens) and ``env_rewards``
    (the episode's reward, which the score stage takes instead of a verifier's), their ``token_versions``
    cover the whole response, the staleness record counts the model's tokens only, and the record carries
    each episode's :class:`~relayrl.environments.base.EpisodeSummary`."""
    n = len(comps)
    if episodes is not None:
        versions = [torch.tensor(e.token_versions, dtype=torch.long) for e in episodes]
        sampled = [v[c.loss_mask.bool()] for v, c in zip(versions, comps)]  # the model's tokens
    else:
        versions = sampled = [c.token_versions for c in comps]
    cols = {
        "prompt_ids": [torch.as_tensor(list(prompt), dtype=torch.long)] * n,
        "response_ids": [x.token_ids for x in comps],
        "gen_logprobs": [x.logprobs for x in comps],
        "token_versions": versions,
        "group": [int(group)] * n,
        "truncated": [float(x.finish_reason == "length") for x in comps],
        "version": [int(v[0]) if len(v) else int(x.weight_version) for v, x in zip(versions, comps)],
    }
    info = {"group": int(group), "lengths": [len(x.token_ids) for x in comps], "prompt_len": len(prompt),
            "truncated": [x.finish_reason == "length" for x in comps],
            "versions": [dict(Counter(v.tolist())) for v in sampled]}
    if episodes is not None:
        cols.update(loss_mask=[c.loss_mask for c in comps], env_rewards=[float(e.reward) for e in episodes])
        info["episodes"] = [e.summary() for e in episodes]
    return cols, info


class StreamingRollout(RolloutWorker):
    """A rollout worker that writes finished prompt groups into the dock while generation goes on.

    With ``partial=True`` a stream takes new weights while it runs: :meth:`receive_weights` called during
    the stream hands the payload to the generation thread, which loads it between two decode steps and
    prefills the in-flight rows again (the engine's partial rollout); the call returns once the weights are
    in. Without it, weights may only arrive between streams."""

    def start_stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams, slots: Sequence[Any],
                     groups: Sequence[int], partial: bool = False, baseline: bool = False,
                     episodes: EpisodeSpec | None = None, problems: Sequence[Problem] | None = None,
                     per_sample: bool = False) -> None:
        """Generate ``params.n`` responses for each of ``prompts`` on a thread of this worker; prompt ``i``'s
        group is written to ``slots[i]`` (its ``n`` rows, in sample order) as soon as it is complete. Take
        the receipts with :meth:`poll_stream`. ``partial``: weights may be swapped in mid-stream.
        ``baseline`` (ReMax): one response per prompt (greedy ``params``), written as ``baseline_ids`` into
        every row of the group's existing ``slots[i]``. ``episodes`` (multi-turn, with ``problems[i]`` the
        problem of prompt ``i``): ``params.n`` episodes per problem, a group written when its last episode
        ends, with the ``loss_mask`` and ``env_rewards`` columns (:func:`group_rows`). ``per_sample``: each
        response (or episode) is written into its row the moment it ends, one receipt per row (the score
        stage scores it at once; the other stages still wait for whole groups)."""
        if self._streaming():
            raise RuntimeError("start_stream: the previous stream is still generating")
        if len(slots) != len(prompts) or len(groups) != len(prompts):
            raise ValueError(f"start_stream: {len(prompts)} prompts, {len(slots)} slots, {len(groups)} groups")
        if episodes is not None and (problems is None or len(problems) != len(prompts)):
            raise ValueError("start_stream: episodes need the problem of every prompt")
        self._out: queue.Queue = queue.Queue()
        self._swap = getattr(self, "_swap", None) or _Swap(
            lambda payload: super(StreamingRollout, self).receive_weights(payload))
        n = params.n
        pending: dict[int, list] = {}

        def complete(i: int, item) -> list | None:
            """The group of prompt ``i`` once ``item`` was its last sample, in sample order; else None."""
            got = pending.setdefault(i, [])
            got.append(item)
            if len(got) < n:
                return None
            return sorted(pending.pop(i), key=lambda x: x.sample_index)

        def rows_of(c: Completion) -> list[tuple]:
            """The writes ``(slots, columns, record)`` that finishing ``c`` makes due (none before its group is
            complete, unless written per sample)."""
            i = c.prompt_index
            if per_sample and not baseline:
                return [self._rows(slots[i], prompts[i], groups[i], [c], positions=[c.sample_index])]
            comps = complete(i, c)
            if comps is None:
                return []
            if baseline:
                return [(slots[i], {"baseline_ids": [c.token_ids] * len(slots[i])},
                         {"group": int(groups[i]), "baseline": True})]
            return [self._rows(slots[i], prompts[i], groups[i], comps)]

        def rows_of_episode(ep: Episode) -> list[tuple]:
            eps = [ep] if per_sample else complete(ep.problem_index, ep)
            if eps is None:
                return []
            i = ep.problem_index
            return [self._rows(slots[i], prompts[i], groups[i], [e.completion(self.tokenizer) for e in eps], eps,
                               positions=[ep.sample_index] if per_sample else None)]

        # Finished samples (or episodes) go to a writer thread: a dock write waits on the storage units'
        # replies, and the decode loop must not. The writer takes everything that finished since its last
        # write and stores it in one write (one receipt, one publish), however many groups or rows it spans.
        ended: queue.SimpleQueue = queue.SimpleQueue()

        def writer(due) -> None:
            failed = last = False
            while not last:
                items = [ended.get()]
                while not ended.empty():
                    items.append(ended.get())
                last = items[-1] is None
                if failed:  # (after a failure: drain, so the generation loop never blocks on us)
                    continue
                try:
                    writes = [w for item in items if item is not None for w in due(item)]
                    if writes:
                        self._out.put(self._write_all(writes))
                except BaseException as e:  # noqa: BLE001 - handed to the driver by poll_stream
                    failed = True
                    self._out.put(e)

        def run() -> None:
            writes = threading.Thread(target=writer, args=(rows_of if episodes is None else rows_of_episode,),
                                      name="rollout-writer", daemon=True)
            writes.start()
            try:
                between = self._swap.take if partial else None
                gen = self.generator if params.temperature > 0 else None
                if episodes is None:
                    self.engine.generate(prompts, params, generator=gen, on_finish=ended.put, between=between)
                else:
                    from relayrl.environments.episodes import run_episodes

                    run_episodes(self.engine, self.tokenizer, problems, prompts, self._env(episodes), params,
                                 episodes.limits, workers=episodes.env.workers, generator=gen,
                                 on_end=ended.put, between=between)
            except BaseException as e:  # noqa: BLE001 - handed to the driver by poll_stream
                self._out.put(e)
            finally:
                ended.put(None)
                writes.join()
                self._swap.close()
                self._out.put(_DONE)

        self._swap.open(partial)
        self._stream = compute.submit(run, name="rollout-stream")  # the driver's main thread, or a thread here

    @staticmethod
    def _rows(slots, prompt: Sequence[int], group: int, comps: Sequence[Completion],
              episodes: Sequence[Episode] | None = None, positions: Sequence[int] | None = None) -> tuple:
        """``(slots, columns, record)`` of finished samples of one prompt group: all its rows, in sample order,
        or those at ``positions`` of the group's slots."""
        cols, info = group_rows(prompt, group, comps, episodes)
        return (slots if positions is None else slots.select(positions)), cols, info

    @staticmethod
    def _write_all(writes: Sequence[tuple]) -> tuple[Any, list[dict]]:
        """One dock write of several ``(slots, columns, record)`` (the same columns): ``(receipt, records)``."""
        cols = {k: [v for _, c, _ in writes for v in c[k]] for k in writes[0][1]}
        return Slots.join([sl for sl, _, _ in writes]).write(cols), [info for _, _, info in writes]

    def _streaming(self) -> bool:
        return getattr(self, "_stream", None) is not None and not self._stream.done()

    def receive_weights(self, payload) -> dict[str, Any]:
        """Load packed weights: at once between streams; during a partial stream, by the generation thread
        between two decode steps (this call waits for it); during any other stream it is an error (a batch
        must not mix weight versions)."""
        swap = getattr(self, "_swap", None)
        if swap is None:
            return super().receive_weights(payload)
        return swap.deliver(payload)

    def poll_stream(self, timeout: float = 0.5) -> tuple[list[tuple[Any, list[dict]]], bool]:
        """``([(receipt, records of the groups or rows it wrote: lengths, versions), ...], done)``: what
        finished since the last poll, waiting up to ``timeout`` seconds for the first; an error of the
        generation thread is raised here."""
        got: list = []
        try:
            item = self._out.get(timeout=timeout)
        except queue.Empty:
            return got, False
        while item is not _DONE:
            if isinstance(item, BaseException):
                raise item
            got.append(item)
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return got, False
        self._stream.result()  # (it has put its last item): the next stream may start as soon as this returns
        return got, True


class _Swap:
    """Weights handed from the worker's call thread to its generation thread (partial rollout).

    ``deliver`` (call thread) loads at once when no stream runs, and otherwise parks the payload until the
    generation thread ``take``s it between two decode steps (or ``close``s the stream), then returns what
    the load returned. One payload at a time: the driver's relay call waits for it."""

    def __init__(self, load) -> None:
        self._lock = threading.Lock()
        self._active = self._partial = False
        self._load = load  # loads a payload into the engine (the mixin's receive_weights)
        self._payload = None
        self._done = threading.Event()
        self._result: Any = None

    def open(self, partial: bool) -> None:
        with self._lock:
            self._active, self._partial = True, partial

    def deliver(self, payload) -> Any:
        with self._lock:
            if not self._active:
                return self._load(payload)
            if not self._partial:
                raise RuntimeError("receive_weights during a stream started with partial=False: a batch must not "
                                   "mix weight versions (send weights between streams)")
            self._payload, self._result = payload, None
            self._done.clear()
        self._done.wait()
        if isinstance(self._result, BaseException):
            raise self._result
        return self._result

    def _run_pending(self) -> bool:
        """Load the parked payload, if any (holding the lock); whether one was loaded."""
        if self._payload is None:
            return False
        payload, self._payload = self._payload, None
        try:
            self._result = self._load(payload)
        except BaseException as e:  # noqa: BLE001 - raised in deliver's thread
            self._result = e
        self._done.set()
        return not isinstance(self._result, BaseException)

    def take(self) -> bool:
        """Generation thread, between two decode steps: load parked weights; True when the weights changed."""
        with self._lock:
            return self._run_pending()

    def close(self) -> None:
        """Generation thread, the stream ended: weights parked after the last decode step load now."""
        with self._lock:
            self._active = False
            self._run_pending()


class _DockRows:
    """Mixin for trainer-side workers: ``items`` are ``(reader, slots)`` pairs, one per data-parallel rank
    (``group.split`` hands each rank its own); ``reader.read()`` gives the rows' columns."""

    @staticmethod
    def _read(items: Sequence, fields: Sequence[str] = (), drop_truncated: bool = False):
        """This rank's rows (an empty batch when the driver gave it none: a streamed chunk of fewer groups
        than ranks; the engine still joins the group's collectives) and the slots for its outputs."""
        (reader, slots), = items
        if reader is None:
            return SequenceBatch([], [], {f: [] for f in fields}, []), None
        return rows_batch(reader.read(), fields, drop_truncated), slots


class DockPolicyWorker(_DockRows, PolicyWorker):
    def logprobs_into(self, items: Sequence, column: str, temperature: float = 1.0) -> list:
        """Old-policy log-probs of the rows into ``column``; the write receipt (one per rank)."""
        batch, slots = self._read(items)
        return [slots.write({column: self.logprobs(batch, temperature)})]

    def update_from(self, items: Sequence, loss_fn, fields: Sequence[str], *, drop_truncated: bool = False,
                    **kwargs) -> list[dict]:
        """``update`` on rows read from the dock (the synchronous step: the whole batch at once)."""
        batch, _ = self._read(items, fields, drop_truncated)
        return [self.update(batch, loss_fn, **kwargs)]

    def accumulate_from(self, items: Sequence, loss_fn, fields: Sequence[str], *, drop_truncated: bool = False,
                        **kwargs) -> list[int]:
        """Forward and backward on rows read from the dock, gradients accumulated (periodic asynchrony);
        the optimizer steps at ``finish_accumulation``. Returns the rows trained on."""
        batch, _ = self._read(items, fields, drop_truncated)
        self.accumulate(batch, loss_fn, **kwargs)
        return [len(batch)]


class DockReferenceWorker(_DockRows, ReferenceWorker):
    def logprobs_into(self, items: Sequence, column: str, temperature: float = 1.0) -> list:
        batch, slots = self._read(items)
        return [slots.write({column: self.logprobs(batch, temperature)})]


class DockCriticWorker(_DockRows, CriticWorker):
    def values_into(self, items: Sequence) -> list:
        batch, slots = self._read(items)
        return [slots.write({"values": self.values(batch)})]

    def update_from(self, items: Sequence, loss_fn, fields: Sequence[str], *, drop_truncated: bool = False,
                    **kwargs) -> list[dict]:
        batch, _ = self._read(items, fields, drop_truncated)
        return [self.update(batch, loss_fn, **kwargs)]


class Scored(NamedTuple):
    """What :meth:`ScoreWorker.score_rows` returns for a batch of rows (scalars only)."""

    scores: list[float]
    """The verifier's score of each row."""
    rewards: list[float]
    """Each row's reward after the run's shaping."""
    metrics: dict[str, float]
    """The reward engine's metrics for the call."""
    groups: list[int]
    """Each row's prompt group."""


class ScoreWorker(Worker):
    """The reward and advantage stages, in the driver's process: reads responses from the dock, scores them
    with the run's reward engine (rule verifiers, user functions, a reward model or LLM judge, on this
    worker's pool device when it has one) and writes rewards; computes advantages of
    complete groups (or of the whole batch) and writes them."""

    def __init__(self, reward, tokenizer, algorithm, shape) -> None:
        self.reward, self.tokenizer, self.algorithm, self.shape = reward, tokenizer, algorithm, shape
        if hasattr(self, "device") and reward.cfg.model_device == "auto":  # a rank of a pool (placement.reward=<pool>)
            reward.place(self.device)  # its learned rewards (reward model, judge) run on the pool's device

    def score_rows(self, reader, problems: Sequence) -> Scored:
        """Score the rows (any rows: a group's responses may come in several calls; ``problems[group]`` holds
        each row's prompt and answer): the verifier's scores and the rewards after the run's shaping. Rows
        with ``env_rewards`` (episodes) take those as scores. Nothing is written: the score stage writes a
        group's rewards once all its rows are scored (:meth:`write_rewards`), or drops it (DAPO)."""
        cols = reader.read()
        groups = [int(g) for g in cols["group"]]
        if "env_rewards" in cols:  # multi-turn episodes: their environments gave the rewards
            scores, metrics = [float(r) for r in cols["env_rewards"]], {}
        else:
            texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in cols["response_ids"]]
            probs = [problems[g] for g in groups]
            scores, metrics = self.reward.score([p.prompt for p in probs], texts, [p.answer for p in probs])
        lengths = torch.tensor([len(r) for r in cols["response_ids"]], dtype=torch.float32)
        rewards = self.shape(torch.tensor(scores, dtype=torch.float32), lengths)
        return Scored([float(x) for x in scores], rewards.tolist(), metrics, groups)

    @staticmethod
    def write_rewards(slots, rewards: Sequence[float]) -> Any:
        """Write ``rewards`` (one per slot row); returns the receipt."""
        return slots.write({"rewards": [float(r) for r in rewards]})

    def baseline_into(self, reader, slots, problems: Sequence) -> tuple[Any, list[float]]:
        """ReMax: the (shaped) reward of each group's greedy response (``baseline_ids``, the same in every row
        of the group), written as every row's ``baseline``; returns ``(receipt, one baseline per group)``."""
        cols = reader.read()
        groups = [int(g) for g in cols["group"]]
        first = {g: i for i, g in reversed(list(enumerate(groups)))}
        order = sorted(first)
        ids = [cols["baseline_ids"][first[g]] for g in order]
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in ids]
        scores, _ = self.reward.score([problems[g].prompt for g in order], texts, [problems[g].answer for g in order])
        lengths = torch.tensor([len(r) for r in ids], dtype=torch.float32)
        base = dict(zip(order, self.shape(torch.tensor(scores, dtype=torch.float32), lengths).tolist()))
        return slots.write({"baseline": [base[g] for g in groups]}), [base[g] for g in order]

    def advantages_into(self, reader, slots) -> tuple[Any, dict[str, float]]:
        """Advantages of the rows (whole groups, or the whole batch for batch-whitened estimators)."""
        cols = reader.read()
        out, kl = advantage_rows(
            self.algorithm, torch.tensor([float(r) for r in cols["rewards"]]), [len(r) for r in cols["response_ids"]],
            torch.tensor([int(g) for g in cols["group"]]), gen_logprobs=cols.get("gen_logprobs"),
            ref_logprobs=cols.get("ref_logprobs"), values=cols.get("values"),
            baseline=torch.tensor([float(b) for b in cols["baseline"]]) if "baseline" in cols else None,
            loss_masks=cols.get("loss_mask"))
        return slots.write(out), kl
