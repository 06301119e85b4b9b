"""Which of DiLoCo's exchanges crosses between nodes in which step, and what each carries.

Follows streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication",
2025): the params are split into F fragments, fragment p is exchanged after inner steps
(p + 1) H / F, then every H steps, and its exchange takes tau steps:

    delay (tau) 0     the exchange runs in the step that ends the fragment's H steps
    delay (tau) 1     it runs in the next step
    delay (tau) > 1   its chunk k runs in the (k + 1)-th step after the H steps, k < tau
    background        it starts after the step that ends the H steps, in a program of its
                      own beside the next tau steps, and lands in the tau-th of them

How the params are cut into fragments and chunks is ``sharding/pieces.py``. Nothing here
depends on anything but the settings, so the schedule of a resumed run follows from its step
count.
"""

INNER = "inner"
# In the background (``Schedule(..., background=True)``), what a step does with a fragment's
# exchange: its H steps end there and it starts, or it lands.
START, LAND = "start", "land"


class Schedule:
    """DiLoCo's schedule: ``inner_steps`` H, ``fragments`` F, ``delay`` tau.

    ``events(steps_taken)`` are the exchanges in the next step's program, as ``(fragment,
    chunk)`` pairs (in the background ``(fragment, START)`` and ``(fragment, LAND)``);
    ``phase(steps_taken)`` names that program (``"inner"``, ``"outer"``, ``"outer_0"``...,
    with tau > 1 ``"outer.0"``, ``"outer_1.0+outer_0.2"``...; in the background ``"outer"``
    for a start and ``"outer.land"`` for a landing).
    """

    def __init__(self, inner_steps: int, fragments: int, delay: int, background: bool = False):
        self.inner_steps, self.fragments, self.delay = inner_steps, fragments, delay
        self.background = background
        self._stride = inner_steps // fragments
        self.names = ("outer",) if fragments == 1 else tuple(f"outer_{f}" for f in range(fragments))
        # One period, once every exchange can be in flight: every phase, inner first.
        names = [self.phase(s)[0] for s in range(delay + inner_steps)]
        self.phases = tuple(dict.fromkeys(sorted(names, key=lambda name: name != INNER)))

    @property
    def chunks(self) -> int:
        """How many chunks each exchange is cut into: one per step it takes, one in the
        background."""
        return 1 if self.background else max(self.delay, 1)

    def synced_after(self, steps_taken: int) -> int | None:
        """The fragment whose H steps end with step ``steps_taken`` (counted from 0), if any."""
        done = steps_taken + 1
        if done % self._stride:
            return None
        return (done // self._stride - 1) % self.fragments

    def events(self, steps_taken: int) -> tuple[tuple[int, int | str], ...]:
        """The exchanges in the next step's program: with delay tau >= 1, chunk k of each
        fragment whose H steps ended k + 1 steps before; in the background, ``(f, START)``
        for the fragment whose H steps end with this step and ``(f, LAND)`` for the one whose
        H steps ended tau steps before."""
        if self.background:
            start = self.synced_after(steps_taken)
            ended = steps_taken - self.delay
            land = self.synced_after(ended) if ended >= 0 else None
            return tuple((f, what) for f, what in ((start, START), (land, LAND)) if f is not None)
        if self.delay == 0:
            fragment = self.synced_after(steps_taken)
            return () if fragment is None else ((fragment, 0),)
        ended = [(steps_taken - 1 - k, k) for k in range(self.delay) if steps_taken > k]
        return tuple((f, k) for t, k in ended if (f := self.synced_after(t)) is not None)

    def phase(self, steps_taken: int) -> tuple[str, tuple | str]:
        """``(name, key)`` of the next step's program; the key is its events (or ``"inner"``)."""
        events = self.events(steps_taken)
        if not events:
            return INNER, INNER
        if self.background:
            names = (self.names[f] + (".land" if k == LAND else "") for f, k in events)
            return "+".join(names), events
        if self.delay <= 1:
            return self.names[events[0][0]], events
        return "+".join(f"{self.names[f]}.{k}" for f, k in events), events

    def period(self) -> range:
        """One period of H steps in which every exchange is in its turn."""
        return range(self.delay, self.delay + self.inner_steps)
