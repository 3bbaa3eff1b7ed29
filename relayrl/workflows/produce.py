"""The stages that fill a step's partition: generation, rewards, and ReMax's greedy baseline.

::

    sample:    the rollout ranks stream each prompt group into the partition as its n responses finish;
               dynamic sampling: further rounds of fresh prompts replace dropped groups
    score:     each landed batch of rows -> the scorer -> once every row of a group is scored, its rewards
               are written, or (dynamic sampling) the group is dropped and its rows retired
    baseline:  ReMax: each kept group's greedy response, scored, written as its rows' ``baseline``
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch

from relayrl.algorithms.gdpo import decoupled_rewards
from relayrl.algorithms.retire import pass_rates
from relayrl.config.plan import PARTIAL_POLL_S
from relayrl.engines.reward.extra import sample_fields
from relayrl.environments.extras import EXTRAS_COLUMN
from relayrl.evaluation.runner import as_read
from relayrl.workflows.flow import Flow
from relayrl.workflows.parts import StepParts
from relayrl.workflows.rollout_worker import RolloutWorker
from relayrl.workflows.scoring import ScoreWorker
from relayrl.workflows.step_metrics import add_call_metrics

__all__ = ["Produce"]


class Produce:
    """The producing stages of a step (module docstring)."""

    def __init__(self, parts: StepParts, partial: bool = False) -> None:
        self.p, self.partial = parts, partial

    def stages(self) -> dict:
        """The producing stages of the plan's stage graph."""
        run = {"sample": self.sample, "score": self.score, "baseline": self.baseline}
        return {s.name: run[s.name] for s in self.p.plan.stages if s.producing}

    # ------------------------------------------------------------------ sample
    def sample(self, f: Flow) -> None:
        """Generation rounds until ``P`` groups are kept (one round without dynamic sampling), then ReMax's
        greedy responses of the kept groups; the rows no round used are retired."""
        p, st = self.p, f.state
        P, rounds_max = p.cfg.data.prompts_per_step, p.cfg.algorithm.max_resample_rounds
        todo = list(range(len(st.problems)))
        with p.phases.phase("generate", p.rollout, f.step):
            while True:
                self._generate(f, todo)
                with st.cond:
                    st.rounds += 1
                if not p.plan.group_filter or f.stop.is_set():
                    break
                with st.cond:  # every group of the round judged: kept or dropped (or the flow stopped)
                    while not st.cond.wait_for(lambda: f.stop.is_set() or st.judged == len(st.problems), timeout=0.5):
                        continue
                    need, rounds = P - st.kept, st.rounds
                if need <= 0 or rounds > rounds_max or f.stop.is_set():
                    break
                first = len(st.problems)
                fresh = p.session.prompts.take(need)
                with st.cond:
                    st.problems += fresh
                    st.positions += fresh.positions
                todo = list(range(first, first + need))
            if p.plan.baseline and not f.stop.is_set():
                with st.cond:
                    kept = [g for g in range(len(st.problems)) if g not in st.dropped]
                self._generate(f, kept, baseline=True)
        if p.plan.group_filter and not f.stop.is_set():
            p.dock.retire(f.part)  # the rounds that were not needed
        if st.hold is not None:  # off-policy: the rollout engine is free for the next batch
            st.hold.release()
        p.phases.idle(p.rollout)
        p.phases.wake(p.actor, p.critic)
        f.generated.set()

    def _generate(self, f: Flow, groups: list[int], baseline: bool = False) -> None:
        """One round: prompt groups ``groups`` streamed into the partition by the rollout ranks (each a
        strided share); ``baseline``: one greedy response per group, into its existing rows."""
        p, st, n = self.p, f.state, self.p.sampling.n
        with st.cond:
            problems = list(st.problems)
        if baseline:
            slots = [p.dock.slots(f.part, st.rows[g]) for g in groups]
        else:
            slots = [p.dock.reserve(f.part, n) for _ in groups]
            with st.cond:
                st.rows.update({g: sl.indexes for g, sl in zip(groups, slots)})
        params = p.greedy if baseline else p.sampling
        prompts = [p.session.encode(problems[g]) for g in groups]
        ranks = p.rollout.world_size
        per_sample = p.cfg.reward.stream == "sample" and not baseline
        for r in range(ranks):
            idx = list(range(len(groups)))[r::ranks]
            episodes = {} if p.episodes is None else dict(episodes=p.episodes, problems=[problems[groups[i]] for i in idx])
            p.rollout.one(RolloutWorker.start_stream, [prompts[i] for i in idx], params, [slots[i] for i in idx],
                          [groups[i] for i in idx], partial=self.partial, baseline=baseline, **episodes,
                          per_sample=per_sample, deferred=p.plan.sequential, on_error=p.cfg.rollout.on_error,
                          interrupt=p.interrupt, rank=r)
        live = set(range(ranks))
        # a poll waits for the first finished group; with partial rollout the weights staged meanwhile reach
        # the ranks only between two polls, so it waits briefly (a long wait kept the new weights out of the
        # tail of the batch, up to 0.2 s)
        poll_s = PARTIAL_POLL_S if self.partial else 0.05 if ranks > 1 else 0.2
        while live and not f.stop.is_set():
            for r in sorted(live):
                got, done = p.rollout.one(RolloutWorker.poll_stream, poll_s, rank=r)
                for receipt, records in got:
                    if receipt is None:  # groups whose generation request failed (rollout.on_error=drop_group)
                        self._drop_failed(f, records)
                        continue
                    p.dock.publish(receipt)
                    with st.cond:
                        st.records += [x for x in records if not x.baseline]
                if done:
                    live.discard(r)
            if p.between_polls is not None:
                p.between_polls()

    def _drop_failed(self, f: Flow, records: list) -> None:
        """Groups the rollout could not generate (``rollout.on_error=drop_group``): their rows retired, the
        groups judged and dropped (dynamic sampling's next round replaces them), counted in ``rollout/errors``."""
        p, st = self.p, f.state
        with st.cond:
            rows = [i for r in records for i in st.rows[r.group]]
        p.dock.retire(f.part, rows)
        for r in records:
            p.session.tracker.write_text(f"step {f.step}: dropped the group of prompt "
                                         f"{st.problems[r.group].prompt[:200]!r}: its generation request failed: "
                                         f"{r.failed} (rollout.on_error=drop_group)")
        with st.cond:
            st.dropped |= {r.group for r in records}
            st.judged += len(records)
            st.rollout_errors += len(records)
            st.cond.notify_all()

    # ------------------------------------------------------------------- score
    def score(self, f: Flow) -> None:
        """Score rows as they land; write a group's rewards once all its rows are scored. One call per landed
        batch of whole groups (``reward.stream=group``) or per landed row (``sample``: the rollout writes each
        response as it ends); several calls in flight so a slow one does not hold the rows behind it."""
        p, st, n = self.p, f.state, self.p.sampling.n
        pending: dict[int, dict[int, tuple]] = {}  # group -> row -> (score, reward, each); under st.cond

        def one(b) -> None:
            with st.cond:
                problems = list(st.problems)
                room = max(0, p.cfg.telemetry.samples_per_step - len(st.samples))  # (rows whose log_extra to keep)
            try:
                with p.session.span("reward", "reward", f.step):
                    out = p.score(ScoreWorker.score_rows, p.dock.reader(f.part, b.indexes, cols), problems,
                                  p.session.progress(f.step - 1), room)
            except BaseException:
                f.stop.set()  # the lease loop ends now and the error is raised below (the rows stay unacked)
                raise
            self._keep_samples(f, b.indexes, out, problems)
            b.ack()
            done = []
            with st.cond:
                each = out.each or [None] * len(b.indexes)
                for i, g, score, reward, e in zip(b.indexes, out.groups, out.scores, out.rewards, each):
                    pending.setdefault(g, {})[i] = (score, reward, e)
                scored = sum(x == x for x in out.scores)  # (the reward's means are over the rows not left NaN)
                add_call_metrics(st.reward_metrics, out.metrics, scored, out.rows)
                for g in dict.fromkeys(out.groups):
                    if len(pending[g]) == n:
                        done.append((g, sorted(pending.pop(g).items())))
            if done:
                self._judge(f, done)

        cols = ["response_ids", "group"] + (["env_rewards", EXTRAS_COLUMN] if p.episodes is not None else [])
        per_sample = p.cfg.reward.stream == "sample"
        calls = p.sample_calls if per_sample else p.score_calls
        with ThreadPoolExecutor(calls, thread_name_prefix="score") as pool:
            running: set = set()
            for b in f.leases("score", cols, batch_rows=len(st.problems) * n, whole_groups=not per_sample):
                while len(running) >= calls:
                    done, running = wait(running, return_when=FIRST_COMPLETED)
                    for d in done:
                        d.result()
                running.add(pool.submit(one, b))
            for d in running:
                d.result()

    def _keep_samples(self, f: Flow, rows: list[int], out, problems: list) -> None:
        """``telemetry.samples_per_step``: the step's first scored responses, decoded, kept in the step's state
        for ``RUN_DIR/samples.jsonl`` (a second read of a few rows' ids; nothing when the step has its share), with
        the columns the reward functions logged for them (``log_extra``); a chat prompt, logged as ``role: content``
        lines, also as the model read it (``prompt_text``: its token ids decoded, the template's tokens kept)."""
        p, st = self.p, f.state
        with st.cond:
            room = p.cfg.telemetry.samples_per_step - len(st.samples)
        if room <= 0:
            return
        take = list(range(min(room, len(rows))))
        chat = any("messages" in problems[out.groups[i]].meta for i in take)
        cols = p.dock.reader(f.part, [rows[i] for i in take], ["response_ids", "prompt_ids"] if chat
                             else ["response_ids"]).read()
        tok = p.session.tokenizer
        shown = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if chat else None
        got = [{"group": out.groups[i], "prompt": problems[out.groups[i]].prompt,
                **as_read(problems[out.groups[i]], cols["prompt_ids"][j].tolist() if chat else [], shown),
                "response": tok.decode(r.tolist(), skip_special_tokens=True), "score": out.scores[i],
                "reward": out.rewards[i], "length": len(r),
                **sample_fields(out.extra[i] if out.extra and i < len(out.extra) else {})}
               for j, (i, r) in enumerate(zip(take, cols["response_ids"]))]
        with st.cond:
            st.samples.extend(got[:max(0, p.cfg.telemetry.samples_per_step - len(st.samples))])

    def _judge(self, f: Flow, done: list[tuple[int, list[tuple[int, tuple]]]]) -> None:
        """Groups whose rows are all scored (``(group, [(row, (score, reward, each)), ...])``): the kept groups'
        rewards (and GDPO's per-function scores) in one write; dynamic sampling drops a group whose scores (or
        shaped rewards: ``algorithm.dynamic_sampling_metric=reward``) are all equal (no signal; GDPO: whose every
        function's scores are): no rewards, its rows retired so no later stage waits for them."""
        p, st = self.p, f.state
        rows = [i for _, got in done for i, _ in got]
        groups = torch.tensor([g for g, got in done for _ in got])
        scores = torch.tensor([sr[0] for _, got in done for _, sr in got], dtype=torch.float32)
        rewards = [sr[1] for _, got in done for _, sr in got]
        each = [sr[2] for _, got in done for _, sr in got]
        signal = scores
        if p.cfg.reward.decoupled:  # (the advantages' reward: all 0 in a group where every function is flat)
            signal = decoupled_rewards(torch.tensor(each, dtype=torch.float32),
                                       torch.tensor(p.cfg.reward.fn_weights), groups)
        failed = {int(g) for g, s in zip(groups.tolist(), scores.tolist()) if s != s}  # NaN: reward.on_error
        kept_groups = p.plan.keep_groups(signal, torch.tensor(rewards, dtype=torch.float32), groups)
        keep = [k and int(g) not in failed for k, g in zip(kept_groups, groups.tolist())]
        flat: dict[int, list[float]] = {}  # the groups dynamic sampling dropped: their rewards
        for g, k, r in zip(groups.tolist(), kept_groups, rewards):
            if not k and int(g) not in failed:
                flat.setdefault(int(g), []).append(float(r))
        kept = [i for i, k in enumerate(keep) if k]
        if kept:
            p.dock.publish(p.score(ScoreWorker.write_rewards, p.dock.slots(f.part, [rows[i] for i in kept]),
                                   [rewards[i] for i in kept],
                                   [each[i] for i in kept] if p.cfg.reward.decoupled else None))
        if len(kept) < len(rows):
            p.dock.retire(f.part, [r for r, k in zip(rows, keep) if not k])
        # every judged group's pass rate (data.retire_solved), solved at data.retire_score
        rates = pass_rates(scores.tolist(), groups.tolist(), p.cfg.data.retire_score)
        with st.cond:
            st.pass_rates.update(rates)
            st.scores += [float(scores[i]) for i in kept]
            st.rewards += [rewards[i] for i in kept]
            st.dropped |= {int(g) for g, k in zip(groups.tolist(), keep) if not k}
            st.filtered_rewards.update({g: sum(rs) / len(rs) for g, rs in flat.items()})
            st.judged += len(done)
            st.kept += sum(1 for g, _ in done if g not in st.dropped)
            st.cond.notify_all()

    # ---------------------------------------------------------------- baseline
    def baseline(self, f: Flow) -> None:
        """ReMax: score each kept group's greedy response as its baseline, as they land."""
        p, st = self.p, f.state
        for b in f.leases("baseline", ["baseline_ids", "group"], batch_rows=p.sampling.n * len(st.problems)):
            with st.cond:
                problems = list(st.problems)
            with p.session.span("greedy_baseline", "reward", f.step):
                receipt, base = p.score(ScoreWorker.baseline_into,
                                        p.dock.reader(f.part, b.indexes, ["baseline_ids", "group"]),
                                        p.dock.slots(f.part, b.indexes), problems, p.session.progress(f.step - 1))
            p.dock.publish(receipt)
            with st.cond:
                st.baselines += base
            b.ack()
