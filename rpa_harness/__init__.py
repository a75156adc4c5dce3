"""rpa-harness: property-based differential testing of Pallas TPU ragged paged attention kernels."""

# The release, stated once: pyproject.toml reads it as the package's version, and `rpa-harness --version`
# and the run header print it. Semantic: before 1.0 a change that can fail a run that passed (a stricter
# judge, a new failure kind, a declaration a target must now make) is a minor bump, a fix a patch one.
# CHANGELOG.md's newest entry is this version's and says what a run may now report and what to declare.
__version__ = "0.7.0"
