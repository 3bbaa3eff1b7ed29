"""Python client of the dock's service API (``relayrl dock``; routes in ``relayrl.serving.dockapi``).

AsyncFlow's service calls (§5) by their names::

    dock = DockClient("http://127.0.0.1:8100", api_key=None)
    dock.open_partition("step-0", rows=64, group_size=8)
    dock.put_prompts_data("step-0", [[1, 2, 3], ...], put_id="prompts-0")          # column prompt_ids
    dock.put_experience_data("step-0", {"response_ids": [...], "reward": [...]}, indexes=idx, put_id="gen-0")
    batch = dock.get_experience_data("step-0", stage="update", columns=["response_ids", "reward"],
                                     batch_size=16, consumer_id="trainer-0")
    ...; batch.ack()                                                                  # exactly once
    dock.weight_sync_notify(version=1, path="/ckpt/v1")
    dock.wait_weights(after=0, timeout_s=60)                                          # a producer waits

Retries: connection errors and 503s are retried. A put is retried only when it
carries a ``put_id`` (the service then writes it once however often it
arrives); give one whenever a put may be re-sent, by this process or by a
restarted producer (e.g. ``f"{producer}-{batch_no}"``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from relayrl.dock.loader import ColumnAccess
from relayrl.dock.rowcodec import decode_rows, encode_rows
from relayrl.errors import UserError

__all__ = ["DockClient", "RemoteBatch", "DockServiceError", "WeightNotice"]


class DockServiceError(UserError, RuntimeError):
    """The service refused a call or could not be reached; ``status`` is the HTTP status (0: unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class WeightNotice:
    version: int
    """The newest weight version announced with ``weight_sync_notify``."""
    path: str | None
    """Where those weights are, if the notifier said."""


class RemoteBatch(ColumnAccess):
    """A leased batch from the service: ``indexes``, one tensor per row per column, and ``ack()``."""

    def __init__(self, client: "DockClient", columns: dict[str, list[torch.Tensor]], meta: dict[str, Any]) -> None:
        self._client = client
        self._data = columns
        self.partition: str = meta["partition"]
        self.stage: str = meta["stage"]
        self.generation: int = meta["gen"]
        self.lease_id: int = meta["lease_id"]
        self.indexes: list[int] = meta["indexes"]

    def __len__(self) -> int:
        return len(self.indexes)


    def ack(self) -> list[int]:
        """Acknowledge the rows; returns those retired by this call (none whose lease expired meanwhile)."""
        reply = self._client._call("POST", "/v1/dock/ack", retry=True, json={
            "partition": self.partition, "gen": self.generation, "stage": self.stage, "lease_id": self.lease_id,
            "indexes": self.indexes})
        return reply.json()["acked"]


class DockClient:
    """Calls of the dock's service API; see the module docstring."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 120.0, retries: int = 5) -> None:
        import requests

        self.url = url.rstrip("/")
        for suffix in ("/v1/dock", "/v1"):
            if self.url.endswith(suffix):
                self.url = self.url[: -len(suffix)]
        self.timeout_s, self.retries = timeout_s, retries
        self._requests = requests
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def _call(self, method: str, path: str, *, retry: bool, timeout_s: float | None = None, **kw):
        err = ""
        for attempt in range(self.retries + 1 if retry else 1):
            try:
                r = self._session.request(method, self.url + path, timeout=timeout_s or self.timeout_s, **kw)
            except self._requests.ConnectionError as e:
                err, status = f"cannot reach {self.url}: {e}", 0
            else:
                if r.status_code < 400:
                    return r
                try:
                    msg = r.json()["error"]["message"]
                except Exception:  # noqa: BLE001 - not the service's JSON error: show the text
                    msg = r.text[:500]
                err, status = f"{method} {path}: {r.status_code} {msg}", r.status_code
                if r.status_code != 503:
                    raise DockServiceError(err, status)
            if retry and attempt < self.retries:
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
        raise DockServiceError(err, status)

    # ------------------------------------------------------------ partitions
    def open_partition(self, name: str, rows: int, *, group_size: int = 1,
                       columns: Sequence[str] | None = None) -> None:
        self._call("POST", "/v1/dock/partitions", retry=False,
                   json={"name": name, "rows": rows, "group_size": group_size,
                         "columns": None if columns is None else list(columns)})

    def close_partition(self, name: str) -> None:
        self._call("DELETE", f"/v1/dock/partitions/{name}", retry=True)

    def partitions(self) -> list[str]:
        return self._call("GET", "/v1/dock/partitions", retry=True).json()["partitions"]

    # ------------------------------------------------------------ writes
    def put_experience_data(self, partition: str, columns: Mapping[str, Sequence[Any]], *,
                            indexes: Sequence[int] | None = None, put_id: str | None = None) -> list[int]:
        """Store columns for new rows (or ``indexes``); returns the rows' indexes. With ``put_id`` the put is
        written once however often it is sent (and is retried on connection errors)."""
        meta = {"partition": partition, "put_id": put_id, "indexes": None if indexes is None else list(indexes)}
        body = encode_rows(columns, meta)
        reply = self._call("POST", "/v1/dock/put", retry=put_id is not None, data=body,
                           headers={"Content-Type": "application/x-relayrl-rows"})
        return reply.json()["indexes"]

    def put_prompts_data(self, partition: str, prompts: Sequence[Sequence[int]], *, put_id: str | None = None,
                         **columns: Sequence[Any]) -> list[int]:
        """New rows whose ``prompt_ids`` are ``prompts`` (token ids), with any further columns."""
        ids = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
        return self.put_experience_data(partition, {"prompt_ids": ids, **columns}, put_id=put_id)

    # ------------------------------------------------------------ reads
    def get_experience_data(self, partition: str, stage: str, columns: Sequence[str], batch_size: int, *,
                            consumer_id: str, whole_groups: bool = False, eager: bool = False,
                            timeout_s: float = 30.0) -> RemoteBatch | None:
        """Lease the next batch of ``stage``; None once every row of the partition is acknowledged. Raises
        ``TimeoutError`` when no batch is ready within ``timeout_s``."""
        body = {"partition": partition, "stage": stage, "columns": list(columns), "batch_size": batch_size,
                "consumer_id": consumer_id, "whole_groups": whole_groups, "eager": eager, "timeout_s": timeout_s}
        try:
            r = self._call("POST", "/v1/dock/lease", retry=False, json=body, timeout_s=timeout_s + self.timeout_s)
        except DockServiceError as e:
            if e.status == 408:
                raise TimeoutError(str(e)) from None
            raise
        if r.status_code == 204:
            return None
        cols, meta = decode_rows(r.content)
        return RemoteBatch(self, cols, meta)

    def release(self, consumer_id: str) -> int:
        """Declare ``consumer_id`` dead: its leased rows are re-delivered now; returns rows re-queued."""
        return self._call("POST", "/v1/dock/release", retry=True, json={"consumer_id": consumer_id}).json()["requeued"]

    def progress(self, partition: str, stage: str) -> dict[str, int]:
        return self._call("GET", "/v1/dock/progress", retry=True,
                          params={"partition": partition, "stage": stage}).json()

    # ------------------------------------------------------------ weights
    def weight_sync_notify(self, version: int, path: str | None = None) -> WeightNotice:
        r = self._call("POST", "/v1/dock/weights", retry=True, json={"version": version, "path": path}).json()
        return WeightNotice(r["version"], r["path"])

    def wait_weights(self, after: int = -1, timeout_s: float = 0.0) -> WeightNotice:
        """The newest notice; with ``timeout_s``, wait up to that long for a version newer than ``after``."""
        r = self._call("GET", "/v1/dock/weights", retry=True, params={"after": after, "timeout_s": timeout_s},
                       timeout_s=timeout_s + self.timeout_s).json()
        return WeightNotice(r["version"], r["path"])

    def close(self) -> None:
        self._session.close()

