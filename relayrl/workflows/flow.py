"""The stage threads of one step over one dock partition (:class:`Flow`).

Each stage is a function of the flow run on a thread of its own; it leases ready rows from the dock's
controller (metadata only), hands their indexes to its worker group and publishes the write receipt. The
first error stops every stage and is raised by :meth:`Flow.run`. While the stages run, the calling thread
(the driver's main thread) runs the torch work they route to workers living in the driver
(:mod:`relayrl.cluster.compute`).
"""

from __future__ import annotations

import threading
from typing import Callable

from relayrl.cluster import compute
from relayrl.dock import Dock
from relayrl.workflows.state import StepState

__all__ = ["Flow"]


class Flow:
    """One step's partition ``part`` of ``dock``, its :class:`StepState` and its stage threads."""

    def __init__(self, dock: Dock, part: str, step: int, state: StepState) -> None:
        self.dock, self.part, self.step, self.state = dock, part, step, state
        self.stop = threading.Event()
        self.generated = threading.Event()  # the rollout has written every group
        self.produced = threading.Event()  # the producing stages (sample, score) have all returned
        self.errors: list[BaseException] = []

    def leases(self, stage: str, columns: list[str], *, batch_rows: int | None,
               after: threading.Event | None = None, whole_groups: bool = True):
        """Batches of whole ready groups for ``stage`` (indexes only, leased): ``batch_rows`` at most per batch
        as soon as one group is ready (``None``: the whole partition at once); the caller acks each. ``after``:
        wait for this event first. ``whole_groups=False``: any ready rows, as soon as one is."""
        while after is not None and not after.wait(0.2):
            if self.stop.is_set():
                return
        self.dock.register_stage(stage, columns, whole_groups=whole_groups, token_columns=())
        total = self.dock.progress(self.part, stage)["rows"]
        eager = batch_rows is not None
        size = batch_rows if eager else total
        while not self.stop.is_set():
            try:
                b = self.dock.acquire(self.part, stage, batch_size=size, eager=eager, read=False,
                                      consumer_id=f"{stage}@{self.part}", timeout_s=0.2)
            except TimeoutError:
                continue
            if b is None:
                return
            yield b

    def run(self, stages: dict[str, Callable[["Flow"], None]], *, sequential: bool = False) -> None:
        """Run ``stages`` (name -> function of this flow) to their end; raise the first error. ``sequential``:
        one after another in the given order on this thread, each starting once the one before has returned
        (a step in which every stage waits for the one before: no threads to hand work between)."""
        if sequential:
            with compute.inline():
                for fn in stages.values():
                    fn(self)
            return

        def body(fn) -> None:
            try:
                fn(self)
            except BaseException as e:  # noqa: BLE001 - re-raised by run()
                self.errors.append(e)
                self.stop.set()
            finally:
                compute.wake()

        threads = [threading.Thread(target=body, args=(f,), name=f"stage-{n}", daemon=True)
                   for n, f in stages.items()]
        compute.serve_until(lambda: [t.start() for t in threads], lambda: not any(t.is_alive() for t in threads))
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]
