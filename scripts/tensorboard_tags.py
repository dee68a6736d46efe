"""Print the scalar tags of a TensorBoard log directory, read with TensorBoard's own reader.

Usage: .venv/bin/python scripts/tensorboard_tags.py DIR

One line per tag: how many values, the first and last step, the last value; then the event
files (a rank that took over from a writer that died writes its own).
"""

import argparse
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    directory = parser.parse_args().directory
    files = sorted(directory.glob("events.out.tfevents.*"))
    if not files:
        raise SystemExit(f"{directory}: no TensorBoard event files")
    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    for tag in sorted(accumulator.Tags()["scalars"]):
        events = accumulator.Scalars(tag)
        print(f"{tag:34s} {len(events):4d} values, steps {events[0].step}..{events[-1].step},"
              f" last {events[-1].value:.6g}")
    print(f"{len(files)} event file(s): {', '.join(path.name for path in files)}")


if __name__ == "__main__":
    main()
