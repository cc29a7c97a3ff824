"""`PositionLedger`: which prompt positions are fully trained, for the resume cursor.

A position is `epoch * rows + index in the epoch's order`; the rollout worker sends each one
exactly once, as a group of samples or as an empty group (a filtered prompt, a group without
signal). A position is *consumed* once every sample of it has been trained or dropped. The
cursor is the first position not yet consumed; `consumed_after_cursor` holds the positions
beyond it already consumed (groups finish out of order). The two are what `rollout_state.json`
keeps when free-running, so a resumed worker starts at the cursor, skips exactly those
positions, and neither skips nor replays a prompt (a fixed schedule's checkpoint keeps the next
block's start alone: `checkpoints.cursor_state`).
"""

from __future__ import annotations


class PositionLedger:
    def __init__(self, cursor: int = 0, consumed_after_cursor=(), end: int | None = None):
        self.cursor = cursor
        self.consumed_after_cursor: set[int] = set(consumed_after_cursor)
        self.end = end  # positions of the run (epoch mode); None: it ends by steps
        self.remaining: dict[int, int] = {}  # arrived position -> samples not yet consumed
        self.arrived: set[int] = set()  # arrived positions at or beyond the cursor

    def arrive(self, position: int, samples: int) -> None:
        """A position's group came off the queue with `samples` samples (0: consumed now)."""
        self.arrived.add(position)
        self.remaining[position] = max(samples, 1)
        if samples == 0:
            self.consume(position)

    def consume(self, position: int) -> None:
        """One sample of `position` was trained or dropped."""
        self.remaining[position] -= 1
        if self.remaining[position] > 0:
            return
        del self.remaining[position]
        self.consumed_after_cursor.add(position)
        while self.cursor in self.consumed_after_cursor:
            self.consumed_after_cursor.discard(self.cursor)
            self.arrived.discard(self.cursor)
            self.cursor += 1

    @property
    def finished(self) -> bool:
        """Epoch mode: every position of the run is consumed."""
        return self.end is not None and self.cursor >= self.end

    def has_arrived(self, position: int) -> bool:
        """`position`'s group came off the queue, or was consumed before a resume."""
        return (position < self.cursor or position in self.arrived
                or position in self.consumed_after_cursor)

    def all_arrived(self) -> bool:
        """Epoch mode: every position not yet consumed has come off the queue, so no group is
        left to wait for (False when the run ends by steps)."""
        if self.end is None:
            return False
        return all(self.has_arrived(p) for p in range(self.cursor, self.end))

    def state(self) -> dict:
        """The ledger's part of `rollout_state.json`."""
        return {"next_prompt_index": self.cursor,
                "consumed_after_cursor": sorted(self.consumed_after_cursor)}

    @classmethod
    def from_state(cls, state: dict, end: int | None) -> PositionLedger:
        return cls(state["next_prompt_index"], state["consumed_after_cursor"], end)
