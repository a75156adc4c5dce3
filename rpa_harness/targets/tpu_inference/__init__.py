"""What the targets of tpu-inference's kernels share: the family's floor, beneath every one of them.

tpu-inference ships several ragged paged attention kernels (v3, its head_dim-64 and context-parallel forks,
batched and stacked RPA, MLA v1 and v2, DeepSeek-V4's MLA-SWA, v2), each a target of its own package; v3 is
one of them. What they share lives here, so that a target builds on the family, not on another target:

- ``releases``: which tpu-inference release is installed and which API its v3 kernels have (read from the
  kernel files, never the version string), and the run header;
- ``kernels``: a kernel module loaded without running ``tpu_inference/__init__.py`` (it imports vllm), the
  stand-ins for what the kernel modules ask of vllm's side, and a kernel called under jit;
- ``arguments``: an upstream-style call in the terms of the kernels with v3's API (new tokens, packed
  cache, distribution, block sizes, options);
- ``judging``: the family's own property, both outputs of a call judged (the attention and the cache);
- ``messages`` and ``rules``: v3's validators' messages and rule table, which the kernels with v3's
  validators take theirs from;
- ``findings``: what the family's findings share (v3's logits, the mask value that gives masked keys
  weight, the edits that keep a finding's case but for the finding);
- ``report``: the upstream-ready report's skeleton, which each target fills with its kernel;
- ``kit``: what a target's profile is built from; ``experimental``: what the adapters of the experimental
  kernels derived from v3 share.

None of these imports a target; v3's own rules and findings are its forks' to build on (the hd64 and CP
targets), and every other target imports only this package and its own modules
(tests/unit/test_targets.py checks it).
"""
