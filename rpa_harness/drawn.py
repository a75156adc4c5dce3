"""How the benchmarks and `rpa-harness chip agreement` draw their examples with Hypothesis."""

from hypothesis import HealthCheck, settings


def same_examples(count: int) -> settings:
    """Settings for ``count`` examples, the same ones on every run (derandomized, no database), none
    refused for a deadline or a health check: a benchmark times what it draws."""
    return settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
