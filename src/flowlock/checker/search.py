"""Wing and Gong's search with Lowe's memo, over one instance's calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowlock.checker.model import CREATE, GET, INF, Model, SearchOp, step


class Search:
    """Wing and Gong's search with Lowe's memo over one instance's calls.

    Completed calls sit in a doubly linked list of invoke and completion entries, by time.
    The candidates are the invokes before the first completion still listed.
    That keeps real time: a call that completed before another began comes first.
    Placing a call lifts its two entries from the list.
    Reaching a completion means every candidate failed: try the unknown calls, then undo.
    Unknown calls are not listed; each group offers its earliest invoked one.
    Done when every completed call is placed; leftover unknown calls never took effect.

    Two cuts keep ordinary histories linear. A read that sees exactly the known instance
    is placed at once (`_place_forced_read`). An unknown call is not placed where a due
    completed call needs an older version (`_lowest_need`).

    The memo key is (placed completed calls, unknown calls placed per group, model).
    Placed calls are `low` (all below it placed) plus a small bit set above it.
    Frames form a linked list, so the deepest point reached costs nothing to keep.
    """

    def __init__(self, ops: Sequence[SearchOp], start: Model, max_steps: int) -> None:
        self.ops = ops
        self.start = start
        self.max_steps = max_steps
        self.definite = [o for o in ops if o.completed_at != INF]
        self.groups: list[list[SearchOp]] = []
        for o in ops:
            if o.completed_at == INF:
                if o.group == len(self.groups):
                    self.groups.append([])
                self.groups[o.group].append(o)
        self.best: Frame | None = None
        self.best_depth = 0
        self.best_model: Model = start

    def run(self) -> bool | None:
        """True: linearizable; False: not (`best` is the deepest point); None: out of steps."""
        definite = self.definite
        n = len(definite)
        if n == 0:
            return True
        # Entries 1..2n; 0 is the head and 2n + 1 the tail. An entry e > 0 is the invoke of
        # definite[op_of[e]] when is_call[e], else its completion.
        events = sorted(
            [(o.invoked_at, 0, k) for k, o in enumerate(definite)]
            + [(o.completed_at, 1, k) for k, o in enumerate(definite)]
        )
        tail = 2 * n + 1
        op_of = [0] * (tail + 1)
        is_call = [False] * (tail + 1)
        at = [INF] * (tail + 1)
        ret_of = [0] * n
        for e, (t, is_ret, k) in enumerate(events, start=1):
            op_of[e], at[e] = k, t
            if is_ret:
                ret_of[k] = e
            else:
                is_call[e] = True
        self.nxt = list(range(1, tail + 2))
        self.prv = [-1, *range(tail)]
        self.op_of, self.is_call, self.at, self.ret_of = op_of, is_call, at, ret_of
        # What version the model must be at for each call: a read its own, a fire the one
        # before its result, a create none (checked by the model).
        self.needs = [
            o.version if o.kind == GET else None if o.kind == CREATE else (o.version or 0) - 1
            for o in definite
        ]
        self.used = [0] * len(self.groups)
        self.ukey: tuple[int, ...] = tuple(self.used)
        self.seen: set[tuple[int, int, tuple[int, ...], Model]] = set()
        self.model, self.low, self.bits, self.placed, self.steps = self.start, 0, 0, 0, 0
        self.frame: Frame | None = None
        self.e, self.next_group, self.fresh = self.nxt[0], 0, True
        return self._walk()

    def _walk(self) -> bool | None:
        """Place calls until the search ends.

        True: every completed call is placed. False: no order is left. None: out of budget.
        """
        n = len(self.definite)
        while self.placed < n:
            if self.steps > self.max_steps:
                return None
            if not self._place_next() and not self._undo():
                return False
        return True

    def _place_next(self) -> bool:
        """Place the next call that fits at this node; False when none is left.

        Candidates are tried from `self.e` on, then the unknown groups."""
        if self.fresh:
            self.fresh = False
            if None not in self.model and self._place_forced_read():
                return True
        definite, nxt, is_call, op_of = self.definite, self.nxt, self.is_call, self.op_of
        needs, model, seen, ukey = self.needs, self.model, self.seen, self.ukey
        low, bits = self.low, self.bits
        version = model[2]
        e, steps = self.e, 0
        while is_call[e]:
            steps += 1
            k = op_of[e]
            need = needs[k]
            # Most candidates are refused on the version alone: check it before the model.
            if version is None or need is None or need == version:
                after = step(model, definite[k])
                if after is not None:
                    nlow, nbits = place(low, bits, k)
                    key = (nlow, nbits, ukey, after)
                    if key not in seen:
                        seen.add(key)
                        self.steps += steps
                        self._push(e, -1, after, nlow, nbits, forced=False)
                        return True
            e = nxt[e]
        self.steps += steps + 1
        self.e = e
        # A completion: every invoke before it was tried. Then the unknown calls.
        return self._place_unknown(self.at[e])

    def _place_forced_read(self) -> bool:
        """Place a read that sees exactly the (fully known) model, if one is a candidate.

        Why forced: such a read changes nothing, and all it must follow is placed.
        Any order placing it later can place it now instead.
        So when what follows fails, this node fails too."""
        definite, nxt, is_call, op_of, needs = (
            self.definite,
            self.nxt,
            self.is_call,
            self.op_of,
            self.needs,
        )
        model, version = self.model, self.model[2]
        e = nxt[0]
        while is_call[e]:
            self.steps += 1
            k = op_of[e]
            o = definite[k]
            if o.kind == GET and needs[k] == version and o.after == model:
                nlow, nbits = place(self.low, self.bits, k)
                key = (nlow, nbits, self.ukey, model)
                if key in self.seen:
                    return False
                self.seen.add(key)
                self._push(e, -1, model, nlow, nbits, forced=True)
                return True
            e = nxt[e]
        return False

    def _place_unknown(self, limit: float) -> bool:
        """Let the next unknown call of a group take effect, at a point not tried before.

        The group comes from `self.next_group`; the call was invoked by `limit`.
        """
        groups, used = self.groups, self.used
        floor: int | None = -1
        for g in range(self.next_group, len(groups)):
            rank = used[g]
            if rank >= len(groups[g]):
                continue
            o = groups[g][rank]
            if o.invoked_at > limit:
                continue
            after = step(self.model, o)
            if after is None:
                continue
            if floor == -1:
                floor = self._lowest_need()
            if floor is not None and after[2] is not None and floor < after[2]:
                continue  # a completed call due now needs an older version: it would be lost
            used[g] += 1
            ukey = tuple(used)
            used[g] -= 1
            key = (self.low, self.bits, ukey, after)
            if key in self.seen:
                continue
            self.seen.add(key)
            self._push(self.e, g, after, self.low, self.bits, forced=False)
            used[g] += 1
            self.ukey = ukey
            return True
        return False

    def _lowest_need(self) -> int | None:
        """The lowest version a due, unplaced completed call needs (None when none does).

        Versions only grow: an unknown call moving past it would strand that call.
        Without this cut, an unknown fire could stand in for a completed fire of its version.
        The search would then follow it to that fire's completion, at every dead end."""
        nxt, is_call, op_of, needs = self.nxt, self.is_call, self.op_of, self.needs
        lowest: int | None = None
        e = nxt[0]
        while True:
            need = needs[op_of[e]]
            if need is not None and (lowest is None or need < lowest):
                lowest = need
            if not is_call[e]:
                return lowest
            e = nxt[e]

    def _push(self, e: int, group: int, after: Model, low: int, bits: int, *, forced: bool) -> None:
        op = self.definite[self.op_of[e]] if group < 0 else self.groups[group][self.used[group]]
        depth = 1 if self.frame is None else self.frame.depth + 1
        self.frame = Frame(self.frame, op, depth, e, group, self.model, self.low, self.bits, forced)
        self.model, self.low, self.bits = after, low, bits
        if group < 0:
            self.placed += 1
            self._lift(e)

        if depth > self.best_depth:
            self.best, self.best_depth, self.best_model = self.frame, depth, after
        self.e, self.next_group, self.fresh = self.nxt[0], 0, True

    def _undo(self) -> bool:
        """Undo the last placement and go on after it; False when nothing is left.

        A forced placement undoes its parent too."""
        while True:
            frame = self.frame
            if frame is None:
                return False
            self.frame = frame.parent
            self.model, self.low, self.bits = frame.model, frame.low, frame.bits
            if frame.group >= 0:
                self.used[frame.group] -= 1
                self.ukey = tuple(self.used)
                # The same node, at the same completion entry: on to the next group.
                self.e, self.next_group = frame.e, frame.group + 1
            else:
                self.placed -= 1
                self._unlift(frame.e)
                self.e, self.next_group = self.nxt[frame.e], 0
            self.fresh = False
            if not frame.forced:
                return True

    def _lift(self, e: int) -> None:
        nxt, prv = self.nxt, self.prv
        for x in (e, self.ret_of[self.op_of[e]]):
            nxt[prv[x]] = nxt[x]
            prv[nxt[x]] = prv[x]

    def _unlift(self, e: int) -> None:
        nxt, prv = self.nxt, self.prv
        for x in (self.ret_of[self.op_of[e]], e):
            nxt[prv[x]] = x
            prv[nxt[x]] = x

    def deepest(self) -> tuple[list[SearchOp], Model]:
        """The calls placed at the deepest point reached (in order), and the model there."""
        order: list[SearchOp] = []
        frame = self.best
        while frame is not None:
            order.append(frame.op)
            frame = frame.parent
        order.reverse()
        return order, self.best_model


def place(low: int, bits: int, k: int) -> tuple[int, int]:
    """Mark completed call `k` placed in the (low, bits) set.

    Every call below `low` is placed; bit i of `bits` says whether call `low + i` is.
    """
    bits |= 1 << (k - low)
    if bits & 1:
        # Shift out the run of placed calls at the bottom.
        run = ((bits + 1) & ~bits).bit_length() - 1
        return low + run, bits >> run
    return low, bits


@dataclass(slots=True)
class Frame:
    """One placement: the entry (or unknown group) placed and what to restore on undo."""

    parent: Frame | None
    op: SearchOp
    depth: int
    e: int
    group: int
    model: Model
    low: int
    bits: int
    forced: bool
