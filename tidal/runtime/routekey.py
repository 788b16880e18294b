"""Channel keys that name their route."""

from __future__ import annotations

from collections.abc import Hashable


class RouteKey(str):
    """``"src->dst:tag"``: equal to, and hashed as, that string, but it also knows its
    destination rank, so a channel bound to the destination group can deliver the item
    straight to that rank (``Channel.create(..., consumer=group)``)."""

    def __new__(cls, src: int, dst: int, tag: Hashable = ""):
        key = super().__new__(cls, f"{src}->{dst}" + (f":{tag}" if tag != "" else ""))
        key.src, key.dst, key.tag = src, dst, tag
        return key

    def __getnewargs__(self):
        return self.src, self.dst, self.tag

    def __reduce__(self):
        return RouteKey, (self.src, self.dst, self.tag)
