"""TensorBoard event files read back by hand (the TFRecord framing, tensorboardX's protos): no
tensorboard package needed."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2


def tensorboard_events(logdir: Path) -> list[event_pb2.Event]:
    """Every event of the event files under `logdir`, files in name (i.e. creation time) order."""
    events = []
    files = sorted(Path(logdir).glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]  # skip length + its crc
            pos += 12 + length + 4  # + data crc
            events.append(event_pb2.Event.FromString(record))
    return events


def tensorboard_points(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard draws them: every point in the order written, except
    that a session START event at step s (a writer's purge_step) hides the points of steps >= s
    written before it."""
    out: dict[str, list[tuple[int, float]]] = {}
    for event in tensorboard_events(logdir):
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            out = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in out.items()}
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
