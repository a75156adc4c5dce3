"""The kernel's rule table. ``mla_sliding_window_ragged_paged_attention`` raises one ValueError, for block
sizes not given; everything else it checks with bare asserts (a window that is not positive, a cache that is
not uint8, a head_dim whose bytes are not whole cache rows), and it has no dynamic validator, so no rule on
the metadata is declared: a kernel that checks nothing there is not asked to."""

from rpa_harness.strategies.violations import Rule, variants

BLOCK_SIZES = ("num_kv_pages_per_block", "num_queries_per_block")


@variants(len(BLOCK_SIZES))
def break_block_size_given(arrays, options, case, param) -> dict:
    """One of the two block sizes left to a kernel that has no default for it."""
    options[BLOCK_SIZES[param % len(BLOCK_SIZES)]] = None
    return {}


def block_sizes_not_given_message() -> str:
    return "num_kv_pages_per_block and num_queries_per_block must be specified."


RULES: dict[str, Rule] = {
    "block sizes not given": Rule("static", break_block_size_given, block_sizes_not_given_message),
}
