"""The cache judge: a cache a kernel returned against the one it must return, bit for bit, slot by slot.

Shared by the generic properties (a target declaring ``RPA_HARNESS_UPDATES_CACHE``) and the targets that
judge a cache in their kernel's own layout (v3's packed cache, stacked RPA's lanes), below both.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from rpa_harness.failures import CacheMismatch, located
from rpa_harness.targets import layouts


@dataclasses.dataclass(frozen=True)
class ExpectedCache:
    """The cache a kernel that writes the new tokens must return, and whose each slot is: what
    ``cache_mismatch`` reads. Arrays are ``[pages, page_size, ...]`` in the kernel's layout."""

    cache: np.ndarray  # every live key and value in its slot
    before: np.ndarray  # the cache the kernel was given
    new_slots: np.ndarray  # bool [pages, page_size]: the slots the kernel writes
    slot_owner: np.ndarray  # int [pages, page_size]: the live sequence whose page holds the slot, -1 none
    slot_position: np.ndarray  # int [pages, page_size]: the slot's key position in its owner, -1 none


def cache_mismatch(
    actual, expected: ExpectedCache, *, who: str, element: Callable[[int], str] = lambda i: f"element {i}"
) -> CacheMismatch | None:
    """``actual`` against the expected cache bit for bit (NaN payloads included): None where they agree,
    else the mismatch naming up to five differing slots, their owners and roles. ``element`` names a
    slot's element by its flat index (the kernel's layout: a packed word, a head and dim)."""
    actual, cache = np.asarray(actual), expected.cache
    if actual.shape != cache.shape or actual.dtype != cache.dtype:
        return CacheMismatch(
            f"{who} returned a cache of {actual.shape} {actual.dtype}, expected {cache.shape} {cache.dtype}"
        )
    bits = f"u{cache.dtype.itemsize}"
    slot_shape = (*cache.shape[:2], -1)
    differs = (actual.view(bits) != cache.view(bits)).reshape(slot_shape)
    if not differs.any():
        return None
    before = np.asarray(expected.before).view(bits).reshape(slot_shape)
    stale = (actual.view(bits).reshape(slot_shape) == before).all(axis=-1)
    slots = np.argwhere(differs.any(axis=-1))
    lines = []
    for page, slot in slots[:5]:
        owner, position = expected.slot_owner[page, slot], expected.slot_position[page, slot]
        whose = f"sequence {owner}, key position {position}" if owner >= 0 else "a page no live sequence uses"
        role = (
            "a new token's slot" if expected.new_slots[page, slot] else f"a slot {who} must leave unchanged"
        )
        left = ", left as it was" if stale[page, slot] else ""
        flat = np.flatnonzero(differs[page, slot])
        got, wanted = (_bits_and_value(array[page, slot].reshape(-1)[flat[0]]) for array in (actual, cache))
        lines.append(
            f"  page {page}, slot {slot} ({role}; {whose}{left}): {len(flat)} elements differ, first at "
            f"{element(int(flat[0]))}: got {got}, expected {wanted}"
        )
    written = int((differs.any(axis=-1) & expected.new_slots).sum())
    return CacheMismatch(
        f"{who}'s updated cache differs from the expected cache in {_slots(len(slots))} ({written} of "
        f"{_slots(int(expected.new_slots.sum()), 'new-token slot')}, {_slots(len(slots) - written)} it must "
        "leave unchanged):\n" + "\n".join(lines),
        slots=differs.any(axis=-1),
        stale=stale,
    )


def _bits_and_value(element: np.generic) -> str:
    """A cache element as its value and its bits: the cache is judged bit for bit (NaN payloads too)."""
    bits = int(np.asarray(element).view(f"u{element.dtype.itemsize}"))
    return f"{float(element):.8g} (0x{bits:0{2 * element.dtype.itemsize}x})"


def _slots(count: int, noun: str = "slot") -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def expected_upstream_cache(arrays: dict) -> ExpectedCache:
    """What a target declaring ``RPA_HARNESS_UPDATES_CACHE`` must return, in upstream's layout: the case's
    ``kv_pages`` bit for bit (every new token in its slot, every other slot as given), the new tokens'
    slots as ``layouts.split_new_tokens`` finds them."""
    new = layouts.split_new_tokens(
        *(arrays[name] for name in ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"))
    )
    kv_pages = np.asarray(arrays["kv_pages"])
    return ExpectedCache(
        kv_pages, new.poisoned_cache(kv_pages), new.new_slots, new.slot_owner, new.slot_position
    )


def check_updated_cache(cache, arrays: dict, label: str) -> None:
    """The cache a target declaring ``RPA_HARNESS_UPDATES_CACHE`` returned is the expected one, bit for bit."""
    head_dim = np.asarray(arrays["kv_pages"]).shape[-1]

    def element(index: int) -> str:
        head, dim = divmod(index, head_dim)
        return f"{'KV'[head % 2]} head {head // 2}, dim {dim}"

    expected = expected_upstream_cache(arrays)
    mismatch = cache_mismatch(cache, expected, who=label, element=element)
    if mismatch is None:
        return
    kv_lens = np.asarray(arrays["kv_lens"])
    owners: list[int] | np.ndarray = (
        [] if mismatch.slots is None else np.unique(expected.slot_owner[mismatch.slots])
    )
    raise located(CacheMismatch, [kv_lens[owner] for owner in owners if owner >= 0])(
        str(mismatch), mismatch.slots, mismatch.stale
    )
