"""``ForwardPass``: owns every ``SharedKv`` made during one model pass.

    with ForwardPass() as fp:
        kv = fp.register(donor_layer, ViewKv(view, offset=pre_write_offset))
        out = kv.attend(q, scale, mask)            # the donor
        out2 = fp.get(donor_layer).attend(q2, ...)  # a sharer, or the drafter
    # every registered SharedKv is released here, exactly once, also on an exception

Sharers and the drafter look SharedKv up by donor layer and never release them.
Debug mode (``debug=True`` or ``PAGEDKV_CHECK_INVARIANTS=1``): a SharedKv created while
the pass is active but neither registered nor released by the end is a leak; the pass
releases it (so no page leaks) and raises ``KvLeakError``.
"""

from __future__ import annotations

import contextvars
import os
from typing import TYPE_CHECKING, Optional

from pagedkv.errors import KvLeakError, PagedKvError

if TYPE_CHECKING:  # a SharedKv reports itself to the active pass; this module only names the type
    from pagedkv.shared import SharedKv

_ACTIVE: contextvars.ContextVar[Optional[ForwardPass]] = contextvars.ContextVar("pagedkv_pass", default=None)


class ForwardPass:
    def __init__(self, *, debug: bool | None = None) -> None:
        if debug is None:
            debug = os.environ.get("PAGEDKV_CHECK_INVARIANTS", "") not in ("", "0")
        self.debug = debug
        self._owned: dict[int, SharedKv] = {}
        self._created: list[SharedKv] = []  # debug only; strong, or a dropped leak would vanish
        self._token: contextvars.Token | None = None
        self._stage = "new"  # -> "active" in the with-block -> "done" after it

    @staticmethod
    def current() -> ForwardPass | None:
        """The innermost active pass in this context, or None."""
        return _ACTIVE.get()

    def note_created(self, kv: SharedKv) -> None:
        """Called by SharedKv factories so debug mode can find leaks."""
        if self.debug:
            self._created.append(kv)

    def register(self, donor: int, kv: SharedKv) -> SharedKv:
        """Take ownership of ``kv`` as the fetched K/V of ``donor``; returns it."""
        if self._stage != "active":  # (after the block, nothing would ever release it)
            raise PagedKvError("register() outside the pass's with-block")
        if donor in self._owned:
            raise PagedKvError(f"donor layer {donor} already registered in this pass")
        if kv.released:
            raise PagedKvError("cannot register a released SharedKv")
        self._owned[donor] = kv
        return kv

    def get(self, donor: int) -> SharedKv:
        """The SharedKv a donor registered in this pass (for sharers and the drafter)."""
        try:
            return self._owned[donor]
        except KeyError:
            raise PagedKvError(f"donor layer {donor} has not registered K/V in this pass") from None

    def __contains__(self, donor: int) -> bool:
        return donor in self._owned

    def __enter__(self) -> ForwardPass:
        if self._stage != "new":
            raise PagedKvError("a ForwardPass can be entered once")
        self._token = _ACTIVE.set(self)
        self._stage = "active"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _ACTIVE.reset(self._token)
        self._stage = "done"
        owned = list(self._owned.values())
        self._owned.clear()
        errors = []
        for kv in owned:
            try:
                kv.release()
            except Exception as e:  # noqa: BLE001 - release the rest first
                errors.append(e)
        leaked = [kv for kv in self._created if not kv.released and all(kv is not o for o in owned)]
        for kv in leaked:
            kv.release()
        self._created.clear()
        if exc_type is not None:
            return
        if errors:
            raise errors[0]
        if leaked:
            raise KvLeakError(f"{len(leaked)} SharedKv created in this pass were never released: {leaked}")
