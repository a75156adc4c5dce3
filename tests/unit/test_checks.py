"""What the checks report: the returned cache of a target declaring ``RPA_HARNESS_UPDATES_CACHE``, judged
bit for bit slot by slot (a wrong one is a failure of its own kind that names the slots), and a kernel
written against another jax."""

import sys
import threading
import types

import numpy as np
import pytest

from rpa_harness import reference, targets
from rpa_harness.checks import (
    CacheMismatch,
    RaisedOnValidInput,
    WrongOutputLayout,
    check_differential,
    declared_unrunnable,
)
from rpa_harness.device import FAST_INTERPRET, INTERPRET, TPU, Backend
from rpa_harness.strategies.valid import Case
from rpa_harness.targets import layouts
from tests.broken import oracle_output

CASE = Case(
    max_num_batched_tokens=8, max_num_seqs=2, pages_per_seq=4, total_num_pages=8, page_size=8,
    num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=(3, 1), kv_lens=(11, 4),
)  # fmt: skip


def _target(monkeypatch, change_cache):
    """A target returning the oracle's attention and the expected cache as ``change_cache`` alters it."""

    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        out = oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
        new = layouts.split_new_tokens(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        return change_cache(out, np.array(kv_pages), new)

    module = types.ModuleType("cache_target")
    module.ragged_paged_attention = ragged_paged_attention
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    module.RPA_HARNESS_UPDATES_CACHE = True
    monkeypatch.setitem(sys.modules, "cache_target", module)
    return targets.load("cache_target")


def _judge(target):
    check_differential(target, Backend(FAST_INTERPRET), CASE.arrays(), CASE.options())


def test_the_expected_cache_passes(monkeypatch):
    _judge(_target(monkeypatch, lambda out, cache, new: (out, cache)))


def test_a_write_to_a_slot_it_must_leave_unchanged_is_named(monkeypatch):
    def stray_write(out, cache, new):
        page, slot = np.argwhere(~new.new_slots & (new.slot_owner == 1))[0]
        cache[page, slot, 1, 3] += 1
        return out, cache

    with pytest.raises(CacheMismatch) as raised:
        _judge(_target(monkeypatch, stray_write))
    message = str(raised.value)
    assert "in 1 slot (0 of 4 new-token slots, 1 slot it must leave unchanged)" in message, message
    assert (
        "must leave unchanged; sequence 1, key position" in message and "first at V head 0, dim 3" in message
    )


def test_a_nan_payload_differs(monkeypatch):
    def other_nan(out, cache, new):
        page, slot = np.argwhere(new.new_slots)[0]
        cache[page, slot, 0, 0] = np.float32(np.nan)
        other = cache.copy()
        other.view(np.uint32)[page, slot, 0, 0] ^= 1  # the same NaN with another payload
        return out, other

    case = CASE.arrays()
    case["kv_pages"][np.nonzero(layouts.split_new_tokens(**case).new_slots)] = np.nan
    target = _target(monkeypatch, other_nan)
    with pytest.raises(CacheMismatch, match=r"got nan \(0x7fc00001\), expected nan \(0x7fc00000\)"):
        check_differential(target, Backend(FAST_INTERPRET), case, CASE.options())


def test_a_target_that_updates_the_cache_returns_a_pair(monkeypatch):
    with pytest.raises(
        WrongOutputLayout, match=r"returned ndarray; a target declaring RPA_HARNESS_UPDATES_CACHE"
    ):
        _judge(_target(monkeypatch, lambda out, cache, new: out))


def test_a_jax_name_the_installed_jax_lacks_says_what_it_means(monkeypatch):
    def ragged_paged_attention(*args, **options):
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.NO_SUCH_MEMORY_SPACE

    module = types.ModuleType("drifted_target")
    module.ragged_paged_attention = ragged_paged_attention
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "drifted_target", module)
    with pytest.raises(RaisedOnValidInput) as raised:
        _judge(targets.load("drifted_target"))
    message = str(raised.value)
    assert "has no jax.experimental.pallas.tpu.NO_SUCH_MEMORY_SPACE" in message, message
    assert "the kernel was written against another jax version" in message


def test_a_backend_declared_slow_runs_only_when_chosen_by_name(monkeypatch):
    """--rpa-backend=auto skips a target's slow backend with the reason; chosen by name (or by a repro), it
    runs; a backend it does not declare never does."""
    module = types.ModuleType("slow_target")
    module.ragged_paged_attention = oracle_output
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    module.RPA_HARNESS_CAPABILITIES = dict(
        backends=("interpret", "fast-interpret"), slow_backends=("interpret",)
    )
    monkeypatch.setitem(sys.modules, "slow_target", module)
    target = targets.load("slow_target")
    slow = declared_unrunnable(target, Backend(INTERPRET), by_default=True)
    assert slow is not None and "slow_backends=('interpret',)" in slow and "--rpa-backend=interpret" in slow
    assert declared_unrunnable(target, Backend(INTERPRET)) is None
    assert declared_unrunnable(target, Backend(FAST_INTERPRET), by_default=True) is None
    assert "(declared, not tpu)" in str(declared_unrunnable(target, Backend(TPU)))


def test_on_a_chip_the_oracle_runs_while_the_kernel_does(monkeypatch):
    """The tpu backend's differential check computes the oracle on a host thread during the kernel's call:
    here the call waits for the oracle to have started, which it could not if the two took turns (on a
    CPU a tpu backend calls the target as jax would on a chip, without an interpreter)."""
    oracle_started = threading.Event()
    oracle = reference.oracle

    def watched_oracle(*args, **kwargs):
        oracle_started.set()
        return oracle(*args, **kwargs)

    def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        assert oracle_started.wait(timeout=20), "the oracle did not start while the kernel ran"
        return oracle_output(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)

    module = types.ModuleType("waiting_target")
    module.ragged_paged_attention = ragged_paged_attention
    module.dynamic_validate_inputs = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "waiting_target", module)
    monkeypatch.setattr(reference, "oracle", watched_oracle)
    check_differential(targets.load("waiting_target"), Backend(TPU), CASE.arrays(), CASE.options())
