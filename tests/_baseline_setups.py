"""Setups for `benchmarks.baseline_process` tests (the child imports them by name)."""

from benchmarks.baseline_process import Channel, SelfDriven


def half_of_index():
    """run(i) -> i / 2: a baseline whose 'seconds' show which run the child answered."""
    return lambda i: i / 2


def loop_of(steps: int) -> SelfDriven:
    """A library-style loop of `steps` steps that answers one run request per step."""

    def serve(channel: Channel) -> None:
        for step in range(steps):
            channel.next_run()
            channel.reply(float(step))

    return SelfDriven(serve)


def failing_setup(message: str):
    raise ValueError(message)
