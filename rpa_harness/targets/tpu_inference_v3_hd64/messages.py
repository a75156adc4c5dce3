"""The validation messages of tpu-inference's head_dim-64 kernel that v3's do not have (imports no kernel).

Source: ``static_validate_inputs`` in ``tpu_inference/kernels/ragged_paged_attention/v3/kernel_hd64.py``
(PyPI ``tpu-inference`` 0.32.0), rendered with ``f"{x=}"`` as the kernel renders them. Its other messages
are word for word v3's (``rpa_harness.targets.tpu_inference.messages``), but for the block options, which
it checks as upstream names them with v3's ``not_positive_message`` wording.
"""


def attention_sink_length_message(length, num_q_heads) -> str:
    return f"Expected attention_sink.shape[0]={length} to be equal to q.shape[1]={num_q_heads} (num_q_heads)."


def head_dim_not_64_message(head_dim) -> str:
    return f"Expected actual_head_dim={head_dim} to be 64."
