"""The rollout's stream into the dock: generation writes each prompt group the moment its last response
finishes, so the stages after it start on that group while the rest still decode.

HybridFlow's and the transfer dock's workers put into the sample store themselves; here the rollout worker
writes a finished group's columns into the storage units (``start_stream`` / ``poll_stream``: generation
runs on the compute thread, :mod:`relayrl.cluster.compute`, and a writer thread of the worker does the dock
writes; the driver polls for the write receipts and publishes them). Only receipts and
:class:`GroupRecord` (lengths, versions: metadata) reach the driver.

Columns a group's rows get: ``prompt_ids``, ``response_ids``, ``gen_logprobs`` (per token: the behaviour
log-probs), ``token_versions`` (per token: the weight version that sampled it), ``group`` (the prompt
group), ``truncated`` (cut at ``max_new_tokens``), ``version`` (the weights its first token was sampled
with). Multi-turn episodes add ``loss_mask`` (per token: 0 where the environment wrote) and ``env_rewards``
(the episode's reward): the rollout runs the episodes, continuously batched across turns, and writes a group
when its last episode ends. A thinking budget (``rollout.interrupt``) adds ``loss_mask`` too (0 on the
end-of-thinking phrase written into an interrupted response, 1 elsewhere, on every row). An engine that
records MoE routing (``algorithm.routing_replay``) adds ``routed_experts`` (per token of prompt + response:
the experts it was routed to, :mod:`relayrl.models.routing`).

Failures (issue 35 item 1): a prompt's generation request that fails on a server (``rollout.engine=openai``)
stops the stream naming the prompt (``rollout.on_error=fail``), or becomes a :class:`GroupRecord` with
``failed`` set and no rows (``drop_group``: the driver retires the group's rows). An episode that ends with an
environment error stops the stream naming the prompt (``env.on_error=fail``), or is written with a NaN
``env_rewards`` (``drop_group``: the score stage drops its group). No failure is written as a reward.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from relayrl.cluster import compute
from relayrl.data.tasks import Problem
from relayrl.dock import Slots
from relayrl.engines.generation.base import Completion, RequestFailed, SamplingParams
from relayrl.engines.generation.interrupt import Interrupt, generate_interrupted
from relayrl.environments.base import Episode, EpisodeEnd, EpisodeSummary
from relayrl.environments.config import EpisodeSpec
from relayrl.environments.extras import EXTRAS_COLUMN, encode_extras
from relayrl.errors import UserError
from relayrl.models.routing import ROUTES_COLUMN

__all__ = ["StreamingGeneration", "GroupRecord", "group_rows", "GenerationFailed", "EpisodeFailed"]

_DONE = object()


class GenerationFailed(UserError, RuntimeError):
    """A prompt's generation request failed and ``rollout.on_error=fail``: the message names the prompt."""


class EpisodeFailed(UserError, RuntimeError):
    """An episode ended with an environment error and ``env.on_error=fail``: the message names the prompt."""


@dataclass(frozen=True)
class GroupRecord:
    """What the driver learns of a prompt group (or of rows of it) the rollout wrote: metadata, no samples."""

    group: int
    lengths: list[int] = field(default_factory=list)
    """Response tokens of each row written."""
    prompt_len: int = 0
    truncated: list[bool] = field(default_factory=list)
    """Each row was cut at ``max_new_tokens``."""
    versions: list[dict[int, int]] = field(default_factory=list)
    """Per row: ``{weight version: model tokens it sampled}`` (off-policy staleness)."""
    episodes: list[EpisodeSummary] = field(default_factory=list)
    """Multi-turn: each row's episode summary."""
    baseline: bool = False
    """ReMax: the write was the group's greedy response (``baseline_ids``), not samples."""
    failed: str | None = None
    """The group's generation request failed (``rollout.on_error=drop_group``): why; nothing was written."""
    interrupted: list[bool] = field(default_factory=list)
    """``rollout.interrupt``: each row was cut at its thinking budget and given the phrase (empty: off)."""


def group_rows(prompt: Sequence[int], group: int, comps: Sequence[Completion],
               episodes: Sequence[Episode] | None = None) -> tuple[dict[str, list], "GroupRecord"]:
    """The dock columns of finished samples of one prompt group (``comps``: the whole group in sample order,
    or the samples written per row) and their record for the driver (lengths, truncation, tokens per weight
    version: metadata only). Episodes (``comps[i]`` is
    ``episodes[i].completion(...)``) add ``loss_mask`` (0 on the environment's tokens) and ``env_rewards``
    (the episode's reward, which the score stage takes instead of a verifier's), their ``token_versions``
    cover the whole response, and the record carries each episode's
    :class:`~relayrl.environments.base.EpisodeSummary`. Completions with a ``loss_mask`` (episodes, a thinking
    budget's interrupted responses) write it, and the staleness record counts the model's tokens only."""
    n = len(comps)
    masked = comps[0].loss_mask is not None  # (all of a stream's completions have one, or none does)
    if episodes is not None:
        versions = [torch.tensor(e.token_versions, dtype=torch.long) for e in episodes]
    else:
        versions = [c.token_versions for c in comps]
    sampled = [v[c.loss_mask.bool()] for v, c in zip(versions, comps)] if masked else versions  # the model's
    cols = {
        "prompt_ids": [torch.as_tensor(list(prompt), dtype=torch.long)] * n,
        "response_ids": [x.token_ids for x in comps],
        "gen_logprobs": [x.logprobs for x in comps],
        "token_versions": versions,
        "group": [int(group)] * n,
        "truncated": [float(x.finish_reason == "length") for x in comps],
        "version": [int(v[0]) if len(v) else int(x.weight_version) for v, x in zip(versions, comps)],
    }
    if masked:
        cols["loss_mask"] = [c.loss_mask for c in comps]
    routed = [c.routed_experts for c in comps if c.routed_experts is not None]
    if routed:  # (an engine recording MoE routing: algorithm.routing_replay; an episode that never ran a turn: none)
        none = routed[0].new_zeros((0, *routed[0].shape[1:]))
        cols[ROUTES_COLUMN] = [none if c.routed_experts is None else c.routed_experts for c in comps]
    if episodes is not None:
        cols["env_rewards"] = [float(e.reward) for e in episodes]
        cols[EXTRAS_COLUMN] = [encode_extras(e.extras) for e in episodes]  # (the samples' log_extra columns)
    return cols, GroupRecord(group=int(group), lengths=[len(x.token_ids) for x in comps], prompt_len=len(prompt),
                             truncated=[x.finish_reason == "length" for x in comps],
                             versions=[dict(Counter(v.tolist())) for v in sampled],
                             episodes=[e.summary() for e in episodes] if episodes is not None else [],
                             interrupted=[x.interrupted for x in comps] if masked and episodes is None else [])


class StreamingGeneration:
    """Mixin of the rollout worker: a stream that writes finished prompt groups into the dock while
    generation goes on (the worker provides ``engine``, ``tokenizer``, ``generator``, ``_env`` and
    ``receive_weights``).

    With ``partial=True`` a stream takes new weights while it runs: :meth:`receive_weights` called during
    the stream hands the payload to the generation thread, which loads it between two decode steps and
    prefills the in-flight rows again (the engine's partial rollout); the call returns once the weights are
    in. Without it, weights may only arrive between streams."""

    def start_stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams, slots: Sequence[Any],
                     groups: Sequence[int], partial: bool = False, baseline: bool = False,
                     episodes: EpisodeSpec | None = None, problems: Sequence[Problem] | None = None,
                     per_sample: bool = False, deferred: bool = False, on_error: str = "fail",
                     interrupt: Interrupt | None = None) -> None:
        """Generate ``params.n`` responses for each of ``prompts`` on a thread of this worker; prompt ``i``'s
        group is written to ``slots[i]`` (its ``n`` rows, in sample order) as soon as it is complete. Take
        the receipts with :meth:`poll_stream`. ``partial``: weights may be swapped in mid-stream.
        ``baseline`` (ReMax): one response per prompt (greedy ``params``), written as ``baseline_ids`` into
        every row of the group's existing ``slots[i]``. ``episodes`` (multi-turn, with ``problems[i]`` the
        problem of prompt ``i``): ``params.n`` episodes per problem, a group written when its last episode
        ends, with the ``loss_mask`` and ``env_rewards`` columns (:func:`group_rows`). ``per_sample``: each
        response (or episode) is written into its row the moment it ends, one receipt per row (the score
        stage scores it at once; the other stages still wait for whole groups). ``deferred``: write everything
        in one write when generation ends (when every stage waits for generation anyway, a writer working
        beside the decode loop only competes with it for the interpreter). ``on_error`` (``rollout.on_error``)
        and ``episodes.env.on_error``: what a failed request or an environment error does (module docstring).
        ``interrupt`` (``rollout.interrupt``): a thinking budget; the rows get a ``loss_mask``
        (:mod:`relayrl.engines.generation.interrupt`)."""
        if self._streaming():
            raise RuntimeError("start_stream: the previous stream is still generating")
        if len(slots) != len(prompts) or len(groups) != len(prompts):
            raise ValueError(f"start_stream: {len(prompts)} prompts, {len(slots)} slots, {len(groups)} groups")
        if episodes is not None and (problems is None or len(problems) != len(prompts)):
            raise ValueError("start_stream: episodes need the problem of every prompt")
        if episodes is not None and interrupt is not None:
            raise ValueError("start_stream: a thinking budget (interrupt) cuts single responses, not episodes")
        self._out: queue.Queue = queue.Queue()
        self._swap = getattr(self, "_swap", None) or _Swap(
            lambda payload: super(StreamingGeneration, self).receive_weights(payload))
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
                         GroupRecord(group=int(groups[i]), baseline=True))]
            return [self._rows(slots[i], prompts[i], groups[i], comps)]

        env_policy = None if episodes is None else episodes.env.on_error

        def rows_of_episode(ep: Episode) -> list[tuple]:
            if ep.end is EpisodeEnd.ERROR:
                if env_policy == "fail":
                    raise EpisodeFailed(
                        f"an episode of prompt {problems[ep.problem_index].prompt[:200]!r} (sample {ep.sample_index}) "
                        f"ended with an environment error: {ep.error}; fix the environment or tool, or set "
                        f"env.on_error=drop_group to drop such a prompt's group from its step (counted in env/errors)")
                ep.reward = float("nan")  # env.on_error=drop_group: the score stage drops the group
            eps = [ep] if per_sample else complete(ep.problem_index, ep)
            if eps is None:
                return []
            i = ep.problem_index
            return [self._rows(slots[i], prompts[i], groups[i], [e.completion(self.tokenizer) for e in eps], eps,
                               positions=[ep.sample_index] if per_sample else None)]

        # Finished samples (or episodes) go to a writer thread: a dock write waits on the storage units'
        # replies, and the decode loop must not.
        ended: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            writes = threading.Thread(target=self._write_finished,
                                      args=(ended, rows_of if episodes is None else rows_of_episode, groups),
                                      name="rollout-writer", daemon=True)
            if not deferred:
                writes.start()
            try:
                self._generate_into(ended.put, prompts, params, self._swap.take if partial else None, interrupt,
                                    episodes, problems, drop_failed=on_error == "drop_group" and not baseline)
            except RequestFailed as e:  # rollout.on_error=fail (or a ReMax baseline: too late to drop a group)
                self._out.put(self._request_failed(prompts, e))
            except BaseException as e:  # noqa: BLE001 - handed to the driver by poll_stream
                self._out.put(e)
            finally:
                try:
                    ended.put(None)
                    if deferred:
                        writes.start()
                    writes.join()
                    self._swap.close()
                finally:  # (even when a Ctrl-C lands in the lines above: a poller must not wait for ever)
                    self._out.put(_DONE)

        self._swap.open(partial)
        self._stream = compute.submit(run, name="rollout-stream")  # the driver's main thread, or a thread here

    def _generate_into(self, on_end: Callable[[Any], None], prompts: Sequence[Sequence[int]], params: SamplingParams,
                       between: Callable[[], bool] | None, interrupt: Interrupt | None, episodes: EpisodeSpec | None,
                       problems: Sequence[Problem] | None, drop_failed: bool) -> None:
        """The stream's generation, each finished sample (or episode) handed to ``on_end``: under a thinking
        budget, as multi-turn episodes, or plain; ``drop_failed``: a failed request (a server's) goes to
        ``on_end`` too, as its :class:`RequestFailed`, instead of being raised."""
        gen = self.generator if params.temperature > 0 else None
        if interrupt is not None:  # (a server's on_error does not apply: the config refuses it there)
            generate_interrupted(self.engine, prompts, params, interrupt, generator=gen, on_finish=on_end,
                                 between=between)
        elif episodes is None:
            drop = {"on_error": on_end} if drop_failed else {}
            self.engine.generate(prompts, params, generator=gen, on_finish=on_end, between=between, **drop)
        else:
            from relayrl.environments.episodes import run_episodes

            run_episodes(self.engine, self.tokenizer, problems, prompts, self._env(episodes), params,
                         episodes.limits, workers=episodes.env.workers, generator=gen, on_end=on_end,
                         between=between)

    def _write_finished(self, ended: queue.SimpleQueue, due: Callable[[Any], list[tuple]],
                        groups: Sequence[int]) -> None:
        """The stream's writer thread: everything that finished since its last write (``ended``, up to the
        ``None`` that ends the stream) in one dock write, one receipt and one publish, however many groups or
        rows it spans; ``due(item)`` is the writes a finished sample or episode makes due. A failed request
        (``rollout.on_error=drop_group``) becomes a record of its group with no rows. After a failure (handed
        to :meth:`poll_stream`) it drains without writing, so the generation loop never blocks on it."""
        broken = last = False
        while not last:
            items = [ended.get()]
            while not ended.empty():
                items.append(ended.get())
            last = items[-1] is None
            if broken:
                continue
            try:
                writes = [w for item in items if item is not None and not isinstance(item, RequestFailed)
                          for w in due(item)]
                if writes:
                    self._out.put(self._write_all(writes))
                dropped = [GroupRecord(group=int(groups[x.index]), failed=x.cause) for x in items
                           if isinstance(x, RequestFailed)]
                if dropped:
                    self._out.put((None, dropped))
            except BaseException as e:  # noqa: BLE001 - handed to the driver by poll_stream
                broken = True
                self._out.put(e)

    def _request_failed(self, prompts: Sequence[Sequence[int]], e: RequestFailed) -> GenerationFailed:
        """The error of a failed request under ``rollout.on_error=fail``, naming its prompt and the cause."""
        return GenerationFailed(f"generating the responses to prompt {self._text(prompts[e.index])!r} failed: "
                                f"{e.cause}; fix the server, or set rollout.on_error=drop_group to drop such a "
                                f"prompt's group from its step (counted in rollout/errors)")

    def _text(self, prompt: Sequence[int]) -> str:
        """A prompt's text for a message (its token ids decoded, the first 200 characters)."""
        return self.tokenizer.decode(list(prompt), skip_special_tokens=True).strip()[:200]

    @staticmethod
    def _rows(slots, prompt: Sequence[int], group: int, comps: Sequence[Completion],
              episodes: Sequence[Episode] | None = None, positions: Sequence[int] | None = None) -> tuple:
        """``(slots, columns, record)`` of finished samples of one prompt group: all its rows, in sample order,
        or those at ``positions`` of the group's slots."""
        cols, info = group_rows(prompt, group, comps, episodes)
        return (slots if positions is None else slots.select(positions)), cols, info

    @staticmethod
    def _write_all(writes: Sequence[tuple]) -> tuple[Any, list["GroupRecord"]]:
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

    def poll_stream(self, timeout: float = 0.5) -> tuple[list[tuple[Any, list["GroupRecord"]]], bool]:
        """``([(receipt, records of the groups or rows it wrote), ...], done)``: what
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
