"""Producer and consumer processes of the dock service tests: ``python dock_actors.py ROLE URL ...``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from relayrl.dock.client import DockClient
from relayrl.dock.rowcodec import encode_rows

ROWS = 4  # rows per put (one group)


def rows_of(pid: int, b: int) -> dict:
    return {"prompt_ids": [torch.tensor([pid, b, r]) for r in range(ROWS)],
            "reward": [float(pid * 100 + b * 10 + r) for r in range(ROWS)]}


def produce(url: str, pid: int, batches: int, slow_at: int, out: Path) -> None:
    """Put ``batches`` groups with put ids ``{pid}-{b}``; at ``slow_at`` send the body slowly (to be killed)."""
    dock = DockClient(url)
    for b in range(batches):
        if b == slow_at:
            body = encode_rows(rows_of(pid, b), {"partition": "p", "put_id": f"{pid}-{b}", "indexes": None})
            out.with_suffix(".midput").write_text("sending")

            def slowly():
                for i in range(0, len(body), 16):
                    yield body[i:i + 16]
                    time.sleep(0.5)
            dock._session.post(f"{dock.url}/v1/dock/put", data=slowly(), timeout=600)
            raise SystemExit("the slow put should have been killed")
        idx = dock.put_experience_data("p", rows_of(pid, b), put_id=f"{pid}-{b}")
        with out.open("a") as f:
            f.write(json.dumps({"batch": b, "indexes": idx}) + "\n")


def consume(url: str, consumer: str, mode: str, out: Path) -> None:
    """``die``: lease one batch, say so, then hang (to be killed); ``all``: lease and ack until the end."""
    dock = DockClient(url)
    while True:
        batch = dock.get_experience_data("p", "train", ["prompt_ids", "reward"], 8, consumer_id=consumer,
                                         timeout_s=60)
        if batch is None:
            return
        if mode == "die":
            out.write_text(json.dumps(batch.indexes))
            time.sleep(600)
        acked = batch.ack()
        with out.open("a") as f:
            for i, ids, rew in zip(batch.indexes, batch["prompt_ids"], batch["reward"]):
                f.write(json.dumps({"index": i, "ids": ids.tolist(), "reward": float(rew), "acked": i in acked})
                        + "\n")


if __name__ == "__main__":
    role, url = sys.argv[1], sys.argv[2]
    if role == "produce":
        produce(url, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    else:
        consume(url, sys.argv[3], sys.argv[4], Path(sys.argv[5]))
